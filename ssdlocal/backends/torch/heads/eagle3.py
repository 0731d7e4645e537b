"""EAGLE-3 heads in their published form (the checkpoints SGLang and vLLM read): `fc` fuses
three of the target's layer outputs (low, middle, high) into one state; one decoder layer
(`midlayer`) reads the token's embedding and that state side by side (q/k/v over 2 x hidden);
its residual stream is the next step's state; a final norm and an lm_head over a reduced
draft vocabulary, mapped to the target's ids by `d2t` (target id = draft id + d2t[id]).

Positions are the target's: the pair (state after token q, token q + 1) sits at position q
and predicts token q + 2. Which target layers `fc` reads comes from the config
(`eagle_config.eagle_aux_hidden_state_layer_ids`, the residual stream *entering* each layer)
or the published default (2, L/2, L-3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.models.layers import MLP, Attention, LayerArgs, RMSNorm, RopeTable
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.backends.torch.heads.shared import check_state


@dataclass(frozen=True)
class Eagle3Args(LayerArgs):
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # target layers whose *input* fc reads (the published indices)
    norm_before_residual: bool

    @classmethod
    def read(cls, raw: dict, target_layers: int, target_hidden: int) -> Eagle3Args:
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ModelLoadError(
                "an EAGLE head without auxiliary hidden states (EAGLE-1/2) is not supported", "use an EAGLE-3 head"
            )
        heads = raw["num_attention_heads"]
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or (2, target_layers // 2, target_layers - 3)
        aux = tuple(int(i) for i in aux)
        if len(aux) != 3 or not all(1 <= i <= target_layers for i in aux):
            raise ModelLoadError(
                f"the EAGLE-3 head reads target layers {list(aux)}, which a {target_layers}-layer target does not have",
                "use the head trained for this target model",
            )
        rope = raw.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = dict(rope or raw.get("rope_scaling") or {})
        scaling.pop("rope_theta", None)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=None if kind == "default" else {**scaling, "rope_type": kind},
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or target_hidden,
            aux_layers=aux,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's HiddenLayers (backends.base: layer i's *output*) that are these inputs."""
        return tuple(i - 1 for i in self.aux_layers)


class Eagle3Head(nn.Module):
    """fc, midlayer, norm, lm_head and the draft -> target id map; embeddings are the target's."""

    def __init__(self, args: Eagle3Args, embed: nn.Embedding, target_vocab: int) -> None:
        super().__init__()
        self.args, self.embed, self.target_vocab = args, embed, target_vocab
        h = args.hidden_size
        self.fc = nn.Linear(3 * args.target_hidden_size, h, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.midlayer.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.midlayer.self_attn = Attention.of(args, input_size=2 * h)
        self.midlayer.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.midlayer.mlp = MLP(h, args.intermediate_size)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = nn.Linear(h, args.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.long))
        self.rope = RopeTable(args.head_dim, args.rope_theta, args.rope_scaling)

    @property
    def attention(self) -> nn.Module:
        """The attention whose KV cache the runner allocates."""
        return self.midlayer.self_attn

    def cover(self, positions: int, device) -> None:
        """Rotary tables for positions [0, `positions`)."""
        self.rope.cover(positions, device)

    def forward(
        self, ids: Tensor, state: Tensor, positions: Tensor, mask: AttentionMask, fuse: bool
    ) -> tuple[Tensor, Tensor]:
        """ids/positions [B, T]; `state` [B, T, 3 x target hidden] (the target's, `fuse`) or
        [B, T, hidden] (the head's own, from its last step) -> (logits over the target's
        vocabulary [B, T, V] float32, -inf outside the draft vocabulary; the next state [B, T, hidden])."""
        layer = self.midlayer
        hidden = self.fc(state) if fuse else state  # [B, T, H]
        embeds = layer.input_layernorm(self.embed(ids).to(hidden.dtype))  # [B, T, H]
        if self.args.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)  # [B, T, 2H]
        cos, sin = self.rope.at(positions, x.dtype)  # [B, 1, T, D] each
        residual = residual + layer.self_attn(x, cos, sin, positions, mask)  # [B, T, H]
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))  # [B, T, H]
        draft = self.lm_head(self.norm(residual)).float()  # [B, T, V_d]
        logits = draft.new_full((*draft.shape[:-1], self.target_vocab), float("-inf"))  # [B, T, V]
        targets = torch.arange(draft.shape[-1], device=draft.device) + self.d2t  # [V_d]
        logits[..., targets] = draft
        return logits, residual


def load_eagle3(
    path: str | Path, embed: nn.Embedding, target_layers: int, target_vocab: int, device, dtype
) -> Eagle3Head:
    """An EAGLE-3 head directory (config.json + model.safetensors or pytorch_model.bin) for a
    target with `target_layers` layers whose embeddings are `embed`."""
    from ssdlocal.weights.formats.checks import read_config_json

    path = Path(path).expanduser()
    raw = read_config_json(path / "config.json", f"check {path}: an EAGLE-3 head's config.json")
    if raw.get("vocab_size") != target_vocab:
        raise ModelLoadError(
            f"{path} is an EAGLE-3 head for a vocabulary of {raw.get('vocab_size')} tokens, the target has {target_vocab}",
            "use the head trained for this target model",
        )
    args = Eagle3Args.read(raw, target_layers, embed.embedding_dim)
    state = read_weights(path)
    state = {k.removeprefix("model."): v for k, v in state.items() if k not in ("t2d", "embed_tokens.weight")}
    with torch.device("meta"):
        head = Eagle3Head(args, embed, target_vocab)
    hint = "use an EAGLE-3 checkpoint (fc, midlayer, norm, lm_head, d2t)"
    check_state(head, state, f"{path} is not an EAGLE-3 head this version reads", hint, ("embed.",))
    state = {k: v.to(device=device, dtype=torch.long if k == "d2t" else dtype) for k, v in state.items()}
    head.load_state_dict(state, strict=False, assign=True)
    head.embed = embed  # the target's, shared (assign above left it on meta)
    return head.requires_grad_(False).eval()


def read_weights(path: Path) -> dict[str, Tensor]:
    """Every tensor of a head directory's *.safetensors (else *.bin) files."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(
            f"{path} holds no weights (*.safetensors or *.bin)", "point --draft at a draft head directory"
        )
    out = {}
    for f in bins:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out
