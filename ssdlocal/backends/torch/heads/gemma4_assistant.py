"""Gemma 4's MTP assistant (Gemma4AssistantForCausalLM, model_type gemma4_assistant), as
transformers computes it: a few Gemma 4 decoder layers with no keys or values of their own.

Input: the target's token embedding of the newest token beside a state of the target's
width (the target's final hidden state of the token before it, or the assistant's own
projected output of its previous step), projected to the assistant's width
(`pre_projection`). Every layer attends over the target's own cache: a sliding layer over
the keys/values of the target's last sliding layer that owns a cache, a full layer over
its last full one (transformers' `shared_kv_states`: the last layer of each type before
the target's KV-sharing layers); the query sits at the newest token's position, the keys
end one position earlier, and a sliding layer sees the last `sliding_window` + 1 of them
(transformers' inclusive bidirectional window). A final norm gives the logits (the lm_head
is the assistant's tied embedding table; with `use_ordered_embeddings`, only the tokens of
the top `centroid_intermediate_top_k` centroids are scored and the others get the row's
lowest score minus one) and, through `post_projection`, the next step's state. All the
drafts of a round sit at the same position and read the same keys: the assistant has no
cache. Per-layer inputs, double-wide MLPs and mixture-of-experts blocks are refused by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ssdlocal.backends.base import FINAL_HIDDEN, HeadInputs
from ssdlocal.backends.torch.attention import AttentionMask, attend
from ssdlocal.backends.torch.models.gemma3 import FULL, ROPE_OF
from ssdlocal.backends.torch.models.gemma4 import Gemma4Args, Gemma4Norm
from ssdlocal.backends.torch.models.layers import MLP, apply_rope, rope_inv_freq, rope_tables
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.backends.torch.heads.shared import check_state

HINT = "use the assistant published for this target (a Gemma4AssistantForCausalLM directory)"


@dataclass(frozen=True)
class AssistantArgs:
    """The assistant's text layers (Gemma4Args: their widths, heads, norms and rotary
    tables), the target width it reads (`backbone`), its masked vocabulary (centroids: 0
    when it scores every token), and per layer type the target layer whose cache it reads."""

    text: Gemma4Args
    backbone: int
    centroids: int
    top_centroids: int
    reads: dict[str, int]  # layer type -> the target layer whose keys and values it attends over

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states it reads (backends.base.HiddenLayers): the final one."""
        return (FINAL_HIDDEN,)


def assistant_args(cfg, shared: HeadInputs, target_vocab: int, where: Path) -> AssistantArgs:
    """The args of a transformers Gemma4AssistantConfig for a target that shares `shared`."""
    from ssdlocal.weights.formats.archs import architecture, unsupported

    text = copy.copy(cfg.text_config)
    for field in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if getattr(text, field, 0):
            raise unsupported(f"gemma4_assistant with {field}={getattr(text, field)}")
    if getattr(text, "use_double_wide_mlp", False):
        raise unsupported("gemma4_assistant with use_double_wide_mlp=True")
    text.num_kv_shared_layers = 0  # every layer reads the target's cache (`reads`), none its own
    args = Gemma4Args.from_hf_config(text, architecture("gemma4"))
    if cfg.backbone_hidden_size != shared.hidden_size or args.vocab_size != target_vocab:
        raise ModelLoadError(
            f"{where} is an assistant for a {cfg.backbone_hidden_size}-wide target with {args.vocab_size} tokens; "
            f"the target is {shared.hidden_size} wide with {target_vocab}",
            HINT,
        )
    reads = _target_layers(args, shared, where)
    ordered = bool(getattr(cfg, "use_ordered_embeddings", False))
    centroids = int(cfg.num_centroids) if ordered else 0
    if centroids and (args.vocab_size % centroids or not 0 < cfg.centroid_intermediate_top_k <= centroids):
        raise ModelLoadError(
            f"{where}: {centroids} centroids (top {cfg.centroid_intermediate_top_k}) for {args.vocab_size} tokens",
            "the vocabulary must split evenly into the centroids",
        )
    return AssistantArgs(
        args,
        cfg.backbone_hidden_size,
        centroids,
        int(cfg.centroid_intermediate_top_k) if centroids else 0,
        reads,
    )


def _target_layers(args: Gemma4Args, shared: HeadInputs, where: Path) -> dict[str, int]:
    """Per layer type of the assistant, the target layer it reads: the last layer of that
    type that owns its cache before the target's first KV-sharing layer (transformers' "store"
    layers); its head width and kv heads must be the assistant's."""
    first_sharing = next((i for i, kv in enumerate(shared.kv) if kv.source != i), len(shared.kv))
    reads = {}
    for kind in dict.fromkeys(args.layer_types):  # in the order its layers have them
        full = kind == FULL
        owners = [i for i in range(first_sharing) if (shared.kv[i].window is None) == full]
        dim = args.global_head_dim if full else args.head_dim
        if not owners:
            raise ModelLoadError(f"{where} attends over {kind} layers, which the target does not have", HINT)
        kv = shared.kv[owners[-1]]
        if kv.head_dim != dim or args.num_heads % kv.kv_heads:
            raise ModelLoadError(
                f"{where}: its {kind} layers have {args.num_heads} heads of width {dim}; the target's layer "
                f"{owners[-1]} keeps {kv.kv_heads} kv heads of width {kv.head_dim}",
                HINT,
            )
        reads[kind] = owners[-1]
    return reads


class AssistantAttention(nn.Module):
    """Gemma 4's attention of a KV-sharing layer: q projection, per-head q norm, rotary,
    softmax scale 1 over the keys and values it is handed (the target's), o projection."""

    def __init__(self, hidden: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.q_norm = Gemma4Norm(head_dim, eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: AttentionMask) -> Tensor:
        """x [B, T, hidden]; keys/values [B, Hkv, S, D] -> [B, T, hidden]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))  # [B, T, H, D]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        out = attend(q, keys, values, keys, values, mask, scale=1.0)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, hidden]


class AssistantBlock(nn.Module):
    """Gemma 4's decoder layer (models/gemma4.py's Gemma4Block) without keys and values."""

    def __init__(self, args: Gemma4Args, index: int) -> None:
        super().__init__()
        kind, h, eps = args.layer_types[index], args.hidden_size, args.rms_norm_eps
        self.kind, self.rope = kind, ROPE_OF[kind]
        dim = args.global_head_dim if kind == FULL else args.head_dim
        self.self_attn = AssistantAttention(h, args.num_heads, dim, eps)
        self.mlp = MLP(h, args.intermediate_size, act=args.hidden_act)
        self.input_layernorm = Gemma4Norm(h, eps)
        self.post_attention_layernorm = Gemma4Norm(h, eps)
        self.pre_feedforward_layernorm = Gemma4Norm(h, eps)
        self.post_feedforward_layernorm = Gemma4Norm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: AttentionMask) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, keys, values, mask)  # [B, T, hidden]
        x = x + self.post_attention_layernorm(attended)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))  # [B, T, hidden]
        return x * self.layer_scalar  # [B, T, hidden]


class Gemma4Assistant(nn.Module):
    """pre_projection, the layers, norm, lm_head (+ centroids and token_ordering), post_projection."""

    def __init__(self, args: AssistantArgs) -> None:
        super().__init__()
        text, h = args.text, args.text.hidden_size
        self.args = args
        self.pre_projection = nn.Linear(2 * args.backbone, h, bias=False)
        self.layers = nn.ModuleList(AssistantBlock(text, i) for i in range(text.num_layers))
        self.norm = Gemma4Norm(h, text.rms_norm_eps)
        self.lm_head = nn.Linear(h, text.vocab_size, bias=False)
        self.post_projection = nn.Linear(h, args.backbone, bias=False)
        if args.centroids:
            self.centroids = nn.Linear(h, args.centroids, bias=False)
            self.register_buffer("token_ordering", torch.zeros(text.vocab_size, dtype=torch.long))
        self.ropes = text.ropes()
        for name in self.ropes:
            self.register_buffer(f"rope_cos_{name}", None, persistent=False)
            self.register_buffer(f"rope_sin_{name}", None, persistent=False)

    def cover(self, positions: int, device) -> None:
        """Rotary tables for positions [0, `positions`)."""
        for name, (dim, theta, scaling) in self.ropes.items():
            cos = getattr(self, f"rope_cos_{name}")
            if cos is not None and cos.shape[0] >= positions:
                continue
            inv_freq, factor = rope_inv_freq(dim, theta, scaling)
            cos, sin = rope_tables(inv_freq, factor, positions, device)  # [P, R] each
            setattr(self, f"rope_cos_{name}", cos)
            setattr(self, f"rope_sin_{name}", sin)

    def forward(
        self,
        inputs: Tensor,
        positions: Tensor,
        kv: dict[str, tuple[Tensor, Tensor]],
        masks: dict[str, AttentionMask],
    ) -> tuple[Tensor, Tensor]:
        """inputs [B, T, 2 x backbone] (token embedding, state); positions [B, T]; per layer
        type the target's keys/values [B, Hkv, S, D] and the mask over them -> (logits [B, T, V]
        float32, the next state [B, T, backbone])."""
        x = self.pre_projection(inputs)  # [B, T, H]
        tables = {}
        for name in self.ropes:
            cos, sin = getattr(self, f"rope_cos_{name}"), getattr(self, f"rope_sin_{name}")
            tables[name] = cos[positions].to(x.dtype)[:, None], sin[positions].to(x.dtype)[:, None]  # [B, 1, T, R]
        for layer in self.layers:
            keys, values = kv[layer.kind]
            x = layer(x, *tables[layer.rope], keys, values, masks[layer.kind])  # [B, T, H]
        x = self.norm(x)  # [B, T, H]
        logits = self.masked_logits(x) if self.args.centroids else self.lm_head(x)  # [B, T, V]
        return logits.float(), self.post_projection(x)

    def masked_logits(self, x: Tensor) -> Tensor:
        """Gemma4AssistantMaskedEmbedder: x [B, T, H] -> [B, T, V], scored only for the tokens
        of the top centroids (token_ordering lists each centroid's tokens in turn); the rest
        get the lowest score of their row minus one (transformers: of the whole batch)."""
        B, T, H = x.shape
        top = torch.topk(self.centroids(x), k=self.args.top_centroids, dim=-1).indices  # [B, T, k]
        per_centroid = self.token_ordering.view(self.args.centroids, -1)  # [C, V / C]
        chosen = per_centroid[top].reshape(B, T, -1)  # [B, T, k * V / C] token ids
        rows = self.lm_head.weight[chosen.reshape(-1)].view(B, T, chosen.shape[-1], H)  # [B, T, N, H]
        scores = (x.unsqueeze(-2) @ rows.transpose(-1, -2)).squeeze(-2)  # [B, T, N]
        floor = scores.amin(dim=-1, keepdim=True) - 1.0  # [B, T, 1]
        out = floor.expand(B, T, self.lm_head.weight.shape[0]).clone()  # [B, T, V]
        return out.scatter_(-1, chosen, scores)  # [B, T, V]


def load_assistant(path: str | Path, shared: HeadInputs, target_vocab: int, device, dtype) -> Gemma4Assistant:
    """A Gemma 4 assistant directory (config.json + model.safetensors) for a target that
    shares `shared` (Runner.head_inputs)."""
    from ssdlocal.backends.torch.heads.eagle3 import read_weights
    from ssdlocal.weights.formats.checkpoint import load_hf_config

    path = Path(path).expanduser()
    cfg = load_hf_config(path)
    if getattr(cfg, "model_type", None) != "gemma4_assistant":
        raise ModelLoadError(f"{path} is not a Gemma 4 assistant (model_type {cfg.model_type!r})", HINT)
    args = assistant_args(cfg, shared, target_vocab, path)
    state = {k.removeprefix("model.").replace("masked_embedding.", ""): v for k, v in read_weights(path).items()}
    embeddings = state.pop("embed_tokens.weight", None)  # the assistant's own: only its (tied) lm_head reads it
    if "lm_head.weight" not in state and embeddings is not None:
        state["lm_head.weight"] = embeddings
    with torch.device("meta"):
        head = Gemma4Assistant(args)
    check_state(head, state, f"{path} is not a Gemma 4 assistant this version reads", HINT)
    if args.centroids and not torch.equal(state["token_ordering"].long().sort().values, torch.arange(target_vocab)):
        raise ModelLoadError(f"{path}: token_ordering is not an ordering of the vocabulary", HINT)
    state = {k: v.to(device, torch.long if k == "token_ordering" else dtype) for k, v in state.items()}
    head.load_state_dict(state, assign=True)
    return head.requires_grad_(False).eval()
