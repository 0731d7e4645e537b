"""DFlash block drafters in their published forms: transformers' (`model_type`
muse_glimmer_assistant: `encoder.fc`, `encoder.output_norm_enc`) and z-lab's
(`DFlashDraftModel`, a Qwen3 config with a `dflash_config`: `fc`, `hidden_norm`).

The encoder projects the target's hidden states at `target_layer_ids` (the residual stream
after each layer, concatenated) to the drafter's width; each drafter layer turns them into
keys and values at the target's positions (k_proj/k_norm/rope and v_proj, no layer norm
and no query: `context`). A block is [last verified token, mask x (block_size - 1)] at the
next positions; its queries attend to every context position and to the whole block (no
causal mask; a sliding layer sees the positions within its window on both sides), and the
final norm of positions 1.. through the TARGET's lm_head gives block_size - 1 drafts at
once (`block`). Embeddings and lm_head are the target's (the checkpoints hold neither).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ssdlocal.backends.base import FINAL_HIDDEN
from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.logits import fp32_logits
from ssdlocal.backends.torch.models.layers import MLP, Attention, LayerArgs, RMSNorm, apply_rope, RopeTable
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.backends.torch.heads.shared import check_state

MUSE = "muse_glimmer_assistant"
HINT = "use a DFlash drafter trained for this target (transformers' muse_glimmer_assistant form or z-lab's DFlashDraftModel)"
# MuseGlimmerAssistantConfig's defaults (transformers), for keys a config.json leaves out
MUSE_DEFAULTS = {
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "sliding_window": 2048,
    "hidden_act": "silu",
    "block_size": 16,
    "mask_token_id": 201818,
    "target_layer_ids": [1, 13, 25, 37, 49],
    "rope_theta": 500000.0,
}
# z-lab options this version does not build (a different drafter, not a renaming)
UNBUILT = ("conv_kernel_size", "selector_rank", "attention_sink_bias", "use_swa")


@dataclass(frozen=True)
class DFlashArgs(LayerArgs):
    num_layers: int
    hidden_act: str
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_layers: int
    reach: tuple[int | None, ...]  # per layer: a query sees positions within this distance (None: all)
    scaled_embeddings: bool  # the target's embedding scale applies (transformers' form; z-lab's reads raw rows)

    @classmethod
    def read(cls, raw: dict, target_layers: int) -> DFlashArgs:
        """Either published form; ModelLoadError for what neither form is or this version lacks."""
        zlab = raw.get("model_type") != MUSE
        extra = raw.get("dflash_config") or {}
        names = raw.get("architectures") or ()
        if "DFlash2DraftModel" in names or any(extra.get(k, raw.get(k)) for k in UNBUILT):
            raise ModelLoadError(
                "this DFlash drafter has parts this version does not build (DFlash2's convolutions and "
                "candidate selector, attention sinks, or sliding windows forced on)",
                HINT,
            )
        scaled = [k for k in ("input_embedding_scale", "output_multiplier") if extra.get(k, 1.0) != 1.0]
        if scaled or extra.get("final_logit_softcapping"):
            raise ModelLoadError(f"this DFlash drafter scales its embeddings or logits ({scaled}), not built", HINT)

        def get(name: str):
            if name in extra:
                return extra[name]
            if name in raw and raw[name] is not None:
                return raw[name]
            if not zlab and name in MUSE_DEFAULTS:
                return MUSE_DEFAULTS[name]
            raise ModelLoadError(f"a DFlash drafter's config.json has no {name!r}", HINT)

        layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
        kinds = raw.get("layer_types") or ["sliding_attention" if not zlab else "full_attention"] * layers
        causal = raw.get("is_causal", extra.get("causal"))
        if causal or (zlab and causal is None and "sliding_attention" in kinds):
            raise ModelLoadError(
                "this DFlash drafter has causal layers (z-lab's sliding-window drafters), not built", HINT
            )
        window = int(get("sliding_window")) if "sliding_attention" in kinds else 0
        # transformers: |q - k| <= window; z-lab: |q - k| < window
        reach = tuple((window - 1 if zlab else window) if kind == "sliding_attention" else None for kind in kinds)
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None)
        theta = float(theta if theta is not None else get("rope_theta"))
        kind = rope.get("rope_type", rope.get("type", "default"))
        ids = tuple(int(i) for i in get("target_layer_ids"))
        if not ids or not all(0 <= i < target_layers for i in ids):
            raise ModelLoadError(
                f"the DFlash drafter reads target layers {list(ids)}, which a {target_layers}-layer target does not have",
                HINT,
            )
        return cls(
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or (get("head_dim") if not zlab else int(get("hidden_size")) // heads)),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
            hidden_act=str(raw.get("hidden_act") or "silu"),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=int(get("block_size")),
            mask_token_id=int(get("mask_token_id")),
            target_layer_ids=ids,
            target_layers=target_layers,
            reach=reach,
            scaled_embeddings=not zlab,
        )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's HiddenLayers (backends.base) these are: layer i's output, the last
        layer's after the final norm (transformers' hidden_states[-1] is normed)."""
        return tuple(FINAL_HIDDEN if i == self.target_layers - 1 else i for i in self.target_layer_ids)


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs) -> None:
        super().__init__()
        h, eps, bias = args.hidden_size, args.rms_norm_eps, args.attention_bias
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention.of(args, qkv_bias=bias, o_bias=bias, qk_norm=RMSNorm(args.head_dim, eps))
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, args.intermediate_size, args.hidden_act)


class DFlashHead(nn.Module):
    """encoder (fc, output_norm_enc), layers, norm; embeddings and lm_head are the target's."""

    def __init__(self, args: DFlashArgs, embed: nn.Module, lm_head: nn.Module, embed_scale: float | None) -> None:
        super().__init__()
        self.args, self.embed, self.lm_head, self.embed_scale = args, embed, lm_head, embed_scale
        h = args.hidden_size
        self.encoder = nn.Module()
        self.encoder.fc = nn.Linear(len(args.target_layer_ids) * h, h, bias=False)
        self.encoder.output_norm_enc = RMSNorm(h, args.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.rope = RopeTable(args.head_dim, args.rope_theta, args.rope_scaling)

    def cover(self, positions: int, device) -> None:
        """Rotary tables for positions [0, `positions`)."""
        self.rope.cover(positions, device)

    def context(self, hidden: Tensor, positions: Tensor) -> None:
        """The target's states `hidden` [B, T, n x its width] at `positions` [B, T] -> every
        layer's keys and values there (slot = position)."""
        B, T, _ = hidden.shape
        c = self.encoder.output_norm_enc(self.encoder.fc(hidden))  # [B, T, H]
        cos, sin = self.rope.at(positions, c.dtype)
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(c).view(B, T, attn.n_kv_heads, attn.head_dim)).transpose(1, 2)  # [B, Hkv, T, D]
            v = attn.v_proj(c).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
            attn.kv_cache.update(positions, apply_rope(k, cos, sin), v, 0)

    def block(self, ids: Tensor, positions: Tensor, masks: list[AttentionMask]) -> Tensor:
        """ids/positions [B, bs] (the last verified token, then mask tokens); masks[l]: what
        layer l's queries see -> float32 logits [B, bs - 1, V] for positions 1.. (the drafts)."""
        x = self.embed(ids)  # [B, bs, H]
        if self.embed_scale is not None and self.args.scaled_embeddings:
            x = x * torch.full((), self.embed_scale, device=x.device).to(x.dtype)
        cos, sin = self.rope.at(positions, x.dtype)
        for layer, mask in zip(self.layers, masks):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, positions, mask)  # [B, bs, H]
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # [B, bs, H]
        return fp32_logits(self.lm_head, self.norm(x[:, 1:]))  # [B, bs - 1, V]


def load_dflash(path: str | Path, shared, target_vocab: int, device, dtype) -> DFlashHead:
    """A DFlash drafter directory (config.json + safetensors) beside a target whose
    backends.base.HeadInputs are `shared` (embeddings, lm_head, layers, width)."""
    from ssdlocal.weights.formats.checks import read_config_json

    path = Path(path).expanduser()
    raw = read_config_json(path / "config.json", f"check {path}: a DFlash drafter's config.json")
    args = DFlashArgs.read(raw, shared.layers)
    if not 0 <= args.mask_token_id < target_vocab:
        raise ModelLoadError(
            f"the DFlash drafter's mask token {args.mask_token_id} is outside the target's vocabulary", HINT
        )
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}  # z-lab
    state = {k.removeprefix("model."): v for k, v in _read_safetensors(path).items()}
    state = {renamed.get(k, k): v for k, v in state.items()}
    with torch.device("meta"):
        head = DFlashHead(args, shared.embeddings, shared.lm_head, shared.embed_scale)
    check_state(head, state, f"{path} is not a DFlash drafter this version reads", HINT, ("embed.", "lm_head."))
    fc = state["encoder.fc.weight"]
    if fc.shape[1] != len(args.target_layer_ids) * shared.hidden_size:
        raise ModelLoadError(
            f"the DFlash drafter reads {fc.shape[1]} features, the target gives "
            f"{len(args.target_layer_ids)} x {shared.hidden_size}",
            HINT,
        )
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    head.embed, head.lm_head = shared.embeddings, shared.lm_head  # the target's, shared (assign left them on meta)
    return head.requires_grad_(False).eval()


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the directory's *.safetensors files (the published drafters' format)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weights", "point --draft at a DFlash drafter directory")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
