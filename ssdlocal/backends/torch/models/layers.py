"""The blocks our model families share: norms, rotary tables, attention over the static KV
cache, the gated MLP. A family (one file beside this one) builds its decoder layer from
these with its own options; nothing here knows a family or a file.

Shapes: B rows, T new tokens, S cache slots attended, H query heads, Hkv key/value heads,
D head width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssdlocal.backends.torch.attention import AttentionMask, attend, sink_attention
from ssdlocal.backends.torch.kvcache import KVCache

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class LayerArgs:
    """What a decoder layer's attention, MLP, norms and rotary table read from a config: the
    first fields of every family's args (models/base.ModelArgs) and every head's."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3" | "linear" | "yarn", ...}


class RMSNorm(nn.Module):
    """Root-mean-square norm in float32, as transformers computes it for each family.

    `offset`: the scale is (offset + weight) (Gemma keeps weights around 0: offset 1).
    `scale_in_float`: the scale multiplies the float32 result before the cast back (Gemma,
    gpt-oss); otherwise the result is cast first and then scaled (Llama, Qwen)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, scale_in_float: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset, self.scale_in_float = eps, offset, scale_in_float

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()  # [..., dim]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., dim]
        if self.scale_in_float:
            return (h * (self.offset + self.weight.float())).to(x.dtype)  # [..., dim]
        return (self.offset + self.weight) * h.to(x.dtype)  # [..., dim]


# ------------------------------------------------------------------ rotary embeddings
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "proportional")


def rope_inv_freq(dim: int, theta: float, scaling: Mapping | None) -> tuple[Tensor, float]:
    """Inverse frequencies [dim // 2] float32 and the attention factor the cos/sin tables
    are multiplied by (YaRN's; 1 otherwise), as transformers computes them. `scaling`:
    None, or {"rope_type": "llama3" | "linear" | "yarn" | "proportional", ...} as the config
    gives it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [D/2]
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq  # [D/2]
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # [D/2]
        smooth = (old_len / wavelen - low) / (high - low)  # [D/2]
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)  # [D/2]
        return torch.where(is_medium, smoothed, scaled), 1.0  # [D/2]
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    if kind == "proportional":  # Gemma 4: the first partial_rotary_factor of the angles turn, the rest stay
        angles = int(scaling.get("partial_rotary_factor", 1.0) * dim // 2)
        still = torch.zeros(dim // 2 - angles)  # [D/2 - angles]: frequency 0 (cos 1, sin 0)
        return torch.cat((inv_freq[:angles], still)) / scaling.get("factor", 1.0), 1.0  # [D/2]
    return inv_freq, 1.0


def _yarn(dim: int, theta: float, scaling: Mapping) -> tuple[Tensor, float]:
    """YaRN: extrapolated frequencies for the fast dimensions, interpolated ones (divided
    by `factor`) for the slow, a linear ramp between; attention scaled by `mscale`."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)  # [D/2]
    extrapolate = 1 - ramp  # [D/2]: 1 where the fast dimensions keep their frequency
    inv_freq = (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate  # [D/2]
    return inv_freq, float(attention)


def rope_tables(inv_freq: Tensor, attention_factor: float, positions: int, device) -> tuple[Tensor, Tensor]:
    """cos and sin [P, 2 * len(inv_freq)] float32 for positions [0, P) (each half repeated,
    for `rotate_half`), times the attention factor."""
    freqs = torch.arange(positions, device=device, dtype=torch.float)[:, None] * inv_freq.to(device)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RopeTable(nn.Module):
    """One rotary table, cos and sin [P, dim], for positions [0, P): a draft head's, grown
    by `cover` as its cache grows (a CausalLM keeps one per rope name itself)."""

    def __init__(self, dim: int, theta: float, scaling: Mapping | None) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)

    def cover(self, positions: int, device) -> None:
        """Rotary tables for positions [0, `positions`)."""
        if self.cos is not None and self.cos.shape[0] >= positions:
            return
        inv_freq, factor = rope_inv_freq(self.dim, self.theta, self.scaling)
        self.cos, self.sin = rope_tables(inv_freq, factor, positions, device)

    def at(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """cos and sin at `positions` [B, T], in `dtype`: [B, 1, T, dim] each."""
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat((-x2, x1), dim=-1)  # [..., D]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, R] with R <= D: the first R dims rotate (partial
    rotary leaves the rest as they are)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin  # [B, H, T, D]
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)  # [B, H, T, D]


# ------------------------------------------------------------------ attention
class Attention(nn.Module):
    """q/k/v/o projections, optional per-head q/k norms, rotary positions and attention over
    the layer's KV cache.

    `scale`: the softmax scale (None: 1/sqrt(D)). `window`: a sliding window of this many
    positions (None: the whole context); the model hands a sliding layer the window's mask.
    `sinks`: a learned per-head logit in the softmax denominator (gpt-oss)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: RMSNorm | None = None,
        scale: float | None = None,
        window: int | None = None,
        sinks: bool = False,
        input_size: int | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = hidden if input_size is None else input_size  # q/k/v read this wide (EAGLE-3: 2 x hidden)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm
            self.k_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.offset, qk_norm.scale_in_float)
        self.qk_norm = qk_norm is not None
        self.scale, self.window = scale, window
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None
        self.kv_cache: KVCache | None = None  # set by CausalLM.setup_cache

    @classmethod
    def of(cls, args: LayerArgs, **options) -> Attention:
        """The attention of a layer with `args`' widths and heads; `options` as the constructor's."""
        return cls(args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, **options)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        """mask: which slots each query sees (AttentionMask). None: a fresh prefill (every
        row starts at slot 0, no padding): plain causal attention over the new tokens."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, T, H, D], [B, T, Hkv, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, H, T, D], [B, Hkv, T, D]
        span = T if mask is None else mask.span
        assert self.kv_cache is not None  # setup_cache ran (CausalLM.forward checks)
        keys, values = self.kv_cache.update(slots, k, v, span)  # [B, Hkv, S, D] each
        if self.sinks is not None:
            kv = (k, v) if mask is None else (keys, values)  # what the queries see
            out = sink_attention(q, kv, mask, self.sinks, self.scale)  # [B, H, T, D]
        else:
            out = attend(q, k, v, keys, values, mask, scale=self.scale)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, hidden]


class PreNormBlock(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)): the layer
    of the Llama-like families, whose subclass builds those four modules."""

    rope = "global"

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)  # [B, T, hidden]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, hidden]


# ------------------------------------------------------------------ feed-forward
class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), with the family's activation."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # [B, T, hidden]
