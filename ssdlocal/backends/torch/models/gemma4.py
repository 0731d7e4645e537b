"""Gemma 4 text models (Gemma4ForCausalLM, model_type gemma4_text): E2B/E4B and 31B dense.

Gemma 3's layout (local sliding-window and global layers, four norms per layer, scaled
embeddings, soft-capped logits) with what Gemma 4 changed:
- global layers have their own head width and kv heads (`global_head_dim`,
  `num_global_key_value_heads`: transformers keeps them as `per_layer_config`) and a
  proportional rotary table (only `partial_rotary_factor` of the angles turn);
- with `attention_k_eq_v` a global layer's values are its key projection (no v_proj);
- values are RMS-normed without a scale, the softmax scale is 1, norms scale by weight
  (not 1 + weight) and every layer's output is multiplied by its `layer_scalar`;
- per-layer embeddings (`hidden_size_per_layer_input`): a second embedding table and a
  projection of the token's embedding give each layer a small input that gates a
  residual branch after the feed-forward;
- the last `num_kv_shared_layers` layers compute no keys or values: each reads the cache
  of the last earlier layer of its type (`kv_source`: the model allocates no cache for
  it), and with `use_double_wide_mlp` their MLP is twice as wide.
The mixture-of-experts block (`enable_moe_block`, Gemma 4 26B-A4B) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.attention import AttentionMask, attend
from ssdlocal.backends.torch.kvcache import KVCache
from ssdlocal.backends.torch.models.fields import common_fields
from ssdlocal.backends.torch.models.base import refuse
from ssdlocal.backends.torch.models.gemma3 import FULL, ROPE_OF, SLIDING, GemmaArgs, GemmaLM, layer_types, per_type_rope
from ssdlocal.backends.torch.models.layers import ACTIVATIONS, MLP, apply_rope
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import unsupported

PER_LAYER = ("head_dim", "num_key_value_heads")  # what may differ between layers


def _per_type(cfg, arch: str, types: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(head width, kv heads) of each layer type, read per layer (a heterogeneous config
    refuses global reads of them); a layer differing from the others of its type, or
    another per-layer field, is refused by name."""
    varying = set(getattr(cfg, "per_layer_attributes", None) or ())
    if varying - set(PER_LAYER):
        raise unsupported(f"{arch} with per-layer {', '.join(sorted(varying - set(PER_LAYER)))}")
    views = cfg.per_layer_config if varying else [cfg] * len(types)
    found: dict[str, tuple[int, int]] = {}
    for i, kind in enumerate(types):
        layer = views[i]
        heads = layer.num_attention_heads
        shape = (getattr(layer, "head_dim", None) or layer.hidden_size // heads, layer.num_key_value_heads or heads)
        if found.setdefault(kind, shape) != shape:
            raise unsupported(f"{arch} with {kind} layers of different head shapes")
    return found


def kv_sources(types: tuple[str, ...], shared: int, arch: str) -> tuple[int | None, ...]:
    """Per layer, the earlier layer whose cache it reads (None: its own): each of the last
    `shared` layers reads the last layer of its type before them."""
    first = len(types) - shared
    sources: list[int | None] = []
    for i, kind in enumerate(types):
        if i < first:
            sources.append(None)
            continue
        owners = [j for j in range(first) if types[j] == kind]
        if not owners:
            raise unsupported(f"{arch} with num_kv_shared_layers={shared} (no earlier {kind} layer to share)")
        sources.append(owners[-1])
    return tuple(sources)


@dataclass(frozen=True)
class Gemma4Args(GemmaArgs):
    """ModelArgs' head width and kv heads are the sliding layers', rope_theta and
    rope_scaling the global layers' table."""

    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False  # global layers: values are the key projection
    kv_sources: tuple[int | None, ...] = ()
    double_wide: bool = False  # layers with a kv_source: an MLP twice as wide
    per_layer_width: int = 0  # hidden_size_per_layer_input (0: no per-layer embeddings)
    per_layer_vocab: int = 0

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> Gemma4Args:
        arch = described.name
        refuse(arch, cfg, enable_moe_block=False, use_bidirectional_attention=None)
        act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise unsupported(f"{arch} with hidden_activation={act!r}")
        types = layer_types(cfg, arch)
        shapes = _per_type(cfg, arch, types)
        local, full = shapes.get(SLIDING, shapes.get(FULL)), shapes.get(FULL, shapes.get(SLIDING))
        theta, scaling = per_type_rope(cfg, arch, FULL, ("default", "proportional"))
        alike = cls.read_alike(cfg, described, types, ("default", "proportional"))
        shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
        width = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        return cls(
            **common_fields(cfg, arch, (theta, scaling), tie=True, kv_heads=local[1], head_dim=local[0]),
            **alike,
            hidden_act=act,
            global_head_dim=full[0],
            global_kv_heads=full[1],
            k_eq_v=bool(getattr(cfg, "attention_k_eq_v", False)),
            kv_sources=kv_sources(types, shared, arch),
            double_wide=bool(getattr(cfg, "use_double_wide_mlp", False)),
            per_layer_width=width,
            per_layer_vocab=int(getattr(cfg, "vocab_size_per_layer_input", 0) or cfg.vocab_size) if width else 0,
        )

    def ropes(self) -> dict[str, tuple[int, float, dict | None]]:
        return {
            "global": (self.global_head_dim, self.rope_theta, self.rope_scaling),
            "local": (self.head_dim, self.local_theta, self.local_scaling),
        }

    @property
    def tensor_parallel_sizes(self) -> tuple[tuple[str, int], ...]:
        return (*super().tensor_parallel_sizes, ("global_kv_heads", self.global_kv_heads))


class Gemma4Norm(nn.Module):
    """Gemma 4's RMS norm: in float32, times weight (none with `scale=False`: the values'
    norm), cast back; x * (mean(x^2) + eps)^-0.5 as transformers writes it."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()  # [..., dim]
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)  # [..., dim]
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)  # [..., dim]


class Gemma4Attention(nn.Module):
    """Per-head q/k norms, values normed without a scale, softmax scale 1. `shared`: no
    k/v projections; it reads the cache its layer's `kv_source` owns (the model points
    `kv_cache` there) and writes nothing. `k_eq_v`: the values are the key projection."""

    sinks = None  # (attention sinks: none)
    scale = 1.0

    def __init__(self, args: Gemma4Args, kind: str, *, shared: bool) -> None:
        super().__init__()
        full = kind == FULL
        h, eps, heads = args.hidden_size, args.rms_norm_eps, args.num_heads
        dim, kv = (args.global_head_dim, args.global_kv_heads) if full else (args.head_dim, args.num_kv_heads)
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv, dim
        self.window = None if full else args.sliding_window
        self.shared, self.k_eq_v = shared, full and args.k_eq_v
        self.q_proj = nn.Linear(h, heads * dim, bias=args.qkv_bias)
        self.q_norm = Gemma4Norm(dim, eps)
        if not shared:
            self.k_proj = nn.Linear(h, kv * dim, bias=args.qkv_bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(h, kv * dim, bias=args.qkv_bias)
            self.k_norm = Gemma4Norm(dim, eps)
            self.v_norm = Gemma4Norm(dim, eps, scale=False)
        self.o_proj = nn.Linear(heads * dim, h, bias=args.o_bias)
        self.kv_cache: KVCache | None = None  # its own, or its source's (CausalLM.use_caches)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))  # [B, T, H, D]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        span = T if mask is None else mask.span
        assert self.kv_cache is not None  # setup_cache ran (CausalLM.forward checks)
        if self.shared:  # a fresh prefill's new tokens are the first T slots of the source's cache
            keys, values = self.kv_cache.k[:B, :, :span], self.kv_cache.v[:B, :, :span]  # [B, Hkv, S, D]
            k, v = keys, values
        else:
            k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
            v = k if self.k_eq_v else self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
            v = self.v_norm(v).transpose(1, 2)  # [B, Hkv, T, D]
            keys, values = self.kv_cache.update(slots, k, v, span)  # [B, Hkv, S, D] each
        out = attend(q, k, v, keys, values, mask, scale=self.scale)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, hidden]


class Gemma4Block(nn.Module):
    """Gemma 3's block, then the per-layer input's gated branch, all times layer_scalar."""

    def __init__(self, args: Gemma4Args, index: int) -> None:
        super().__init__()
        kind, h, eps = args.layer_types[index], args.hidden_size, args.rms_norm_eps
        self.rope = ROPE_OF[kind]
        self.kv_source = args.kv_sources[index]  # read by CausalLM: no cache of its own when set
        self.self_attn = Gemma4Attention(args, kind, shared=self.kv_source is not None)
        wide = 2 if args.double_wide and self.kv_source is not None else 1
        self.mlp = MLP(h, args.intermediate_size * wide, act=args.hidden_act)
        self.input_layernorm = Gemma4Norm(h, eps)
        self.post_attention_layernorm = Gemma4Norm(h, eps)
        self.pre_feedforward_layernorm = Gemma4Norm(h, eps)
        self.post_feedforward_layernorm = Gemma4Norm(h, eps)
        if args.per_layer_width:
            self.act = ACTIVATIONS[args.hidden_act]
            self.per_layer_input_gate = nn.Linear(h, args.per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(args.per_layer_width, h, bias=False)
            self.post_per_layer_input_norm = Gemma4Norm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        slots: Tensor,
        mask: AttentionMask | None,
        per_layer: Tensor | None = None,
    ) -> Tensor:
        """x [B, T, hidden]; per_layer [B, T, width]: this layer's input (per-layer embeddings)."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, slots, mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))  # [B, T, hidden]
        if per_layer is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer  # [B, T, width]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))  # [B, T, hidden]
        return x * self.layer_scalar  # [B, T, hidden]


class Gemma4(GemmaLM):
    args: Gemma4Args
    norm_type = Gemma4Norm

    def __init__(self, args: Gemma4Args) -> None:
        super().__init__(args)
        width = args.per_layer_width
        if width:
            self.embed_tokens_per_layer = nn.Embedding(args.per_layer_vocab, args.num_layers * width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, args.num_layers * width, bias=False)
            self.per_layer_projection_norm = Gemma4Norm(width, args.rms_norm_eps)

    def make_layer(self, index: int) -> nn.Module:
        return Gemma4Block(self.args, index)

    def layer_inputs(self, input_ids: Tensor, x: Tensor) -> Tensor | None:
        """Per-layer embeddings [B, T, L, width]: the token's row of the per-layer table (times
        sqrt(width)) and a normed projection of its embedding `x`, summed, times 1/sqrt(2)."""
        width = self.args.per_layer_width
        if not width:
            return None
        B, T = input_ids.shape
        scale = torch.full((), width**0.5, device=x.device).to(x.dtype)  # float32, then the activation dtype
        tokens = (self.embed_tokens_per_layer(input_ids) * scale).view(B, T, -1, width)  # [B, T, L, width]
        projected = self.per_layer_model_projection(x) * self.args.hidden_size**-0.5  # [B, T, L * width]
        projected = self.per_layer_projection_norm(projected.view(B, T, -1, width))  # [B, T, L, width]
        return (projected + tokens) * 2.0**-0.5  # [B, T, L, width]
