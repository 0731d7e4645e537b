"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text; Gemma 3 270M to 27B).

Interleaved local and global layers (`layer_types`: sliding_attention / full_attention,
or the older `sliding_window_pattern`): a local layer attends a sliding window and reads
the local rotary table (`rope_local_base_freq`, or rope_parameters' sliding_attention), a
global layer the whole context with the global table (`rope_theta` and its scaling).
Attention scales by `query_pre_attn_scalar`**-0.5 and normalises q and k per head; four
norms per layer (input, post-attention, pre- and post-feedforward), each (1 + weight) in
float32; embeddings times sqrt(hidden) cast to the activation dtype; a GELU-tanh gated
MLP; logits soft-capped when `final_logit_softcapping` is set; tied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.models.fields import common_fields
from ssdlocal.backends.torch.models.base import CausalLM, ModelArgs, read_rope, refuse
from ssdlocal.backends.torch.models.layers import ACTIVATIONS, MLP, Attention, RMSNorm
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import unsupported

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types
ROPE_OF = {SLIDING: "local", FULL: "global"}  # our rotary tables' names


def layer_types(cfg, arch: str) -> tuple[str, ...]:
    """Each layer's type as the config states it (transformers fills `layer_types` from
    `sliding_window_pattern` when a config has only that); another type is refused."""
    types = tuple(cfg.layer_types)
    for kind in types:
        if kind not in ROPE_OF:
            raise unsupported(f"{arch} with layer type {kind!r}")
    return types


def per_type_rope(cfg, arch: str, kind: str, supported=("default", "linear", "llama3")):
    """(theta, scaling) of layer type `kind`'s rotary table: rope_parameters keyed by layer
    type (transformers 5 folds rope_theta / rope_local_base_freq / rope_scaling into it)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return read_rope(dict(params.get(kind) or {"rope_type": "default"}), cfg, arch, supported)


@dataclass(frozen=True)
class GemmaArgs(ModelArgs):
    """What Gemma 3 and Gemma 4 read alike: sliding (local) and full (global) layers, a
    rotary table for each kind (rope_theta and rope_scaling: the global one's)."""

    hidden_act: str = "gelu_pytorch_tanh"
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_theta: float = 10000.0
    local_scaling: dict | None = None
    final_softcap: float | None = None

    @staticmethod
    def read_alike(cfg, described: Architecture, types: tuple[str, ...], ropes: tuple[str, ...]) -> dict:
        """Those of the fields both read the same way (the local table of rope types `ropes`)."""
        local_theta, local_scaling = per_type_rope(cfg, described.name, SLIDING, ropes)
        qkv_bias, o_bias = described.biases(bool(getattr(cfg, "attention_bias", False)))
        return {
            "qkv_bias": qkv_bias,
            "o_bias": o_bias,
            "sliding_window": cfg.sliding_window if SLIDING in types else None,
            "layer_types": types,
            "local_theta": local_theta,
            "local_scaling": local_scaling,
            "final_softcap": getattr(cfg, "final_logit_softcapping", None),
        }

    @property
    def window(self) -> int | None:
        return self.sliding_window


@dataclass(frozen=True)
class Gemma3Args(GemmaArgs):
    query_scale: float = 1.0  # the softmax scale (query_pre_attn_scalar ** -0.5)

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> Gemma3Args:
        arch = described.name
        refuse(arch, cfg, attn_logit_softcapping=None, use_bidirectional_attention=False)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise unsupported(f"{arch} with hidden_activation={act!r}")
        types = layer_types(cfg, arch)
        theta, scaling = per_type_rope(cfg, arch, FULL)
        alike = cls.read_alike(cfg, described, types, ("default", "linear", "llama3"))
        return cls(
            **common_fields(cfg, arch, (theta, scaling), tie=True),
            **alike,
            hidden_act=act,
            query_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        )

    def ropes(self) -> dict[str, tuple[int, float, dict | None]]:
        return {
            "global": (self.head_dim, self.rope_theta, self.rope_scaling),
            "local": (self.head_dim, self.local_theta, self.local_scaling),
        }


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMS norm: scale (1 + weight), applied in float32 before the cast back."""
    return RMSNorm(dim, eps, offset=1.0, scale_in_float=True)


class Gemma3Block(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, args: Gemma3Args, kind: str) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.rope = ROPE_OF[kind]
        self.self_attn = Attention.of(
            args,
            qkv_bias=args.qkv_bias,
            o_bias=args.o_bias,
            qk_norm=gemma_norm(args.head_dim, eps),
            scale=args.query_scale,
            window=args.sliding_window if kind == SLIDING else None,
        )
        self.mlp = MLP(h, args.intermediate_size, act=args.hidden_act)
        self.input_layernorm = gemma_norm(h, eps)
        self.post_attention_layernorm = gemma_norm(h, eps)
        self.pre_feedforward_layernorm = gemma_norm(h, eps)
        self.post_feedforward_layernorm = gemma_norm(h, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)  # [B, T, hidden]
        x = x + self.post_attention_layernorm(attn)  # [B, T, hidden]
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))  # [B, T, hidden]


class GemmaLM(CausalLM):
    """Gemma 3's and Gemma 4's model: embeddings times sqrt(hidden), logits soft-capped."""

    def __init__(self, args: GemmaArgs) -> None:
        super().__init__(args)
        self.embed_scale = args.hidden_size**0.5
        self.final_softcap = args.final_softcap


class Gemma3(GemmaLM):
    args: Gemma3Args
    norm_type = staticmethod(gemma_norm)

    def make_layer(self, index: int) -> nn.Module:
        return Gemma3Block(self.args, self.args.layer_types[index])
