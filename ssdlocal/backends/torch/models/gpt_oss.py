"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and a learned sink per head on
every layer, a sliding window on the layers `layer_types` calls sliding (every other one in
the published models), one rotary table (YaRN in the published models); every layer's
feed-forward a mixture of experts: a router with a bias picks the top `num_experts_per_tok`
logits and softmaxes those, each expert a gated MLP with biases whose gate and up are
clamped (`swiglu_limit`) before (up + 1) * gate * sigmoid(`swiglu_alpha` * gate). RMS norms
scale in float32 before the cast back. Checkpoints store the experts fused (transformers'
layout, or MXFP4 as published): the description unpacks them (weights/formats/archs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.models.fields import common_fields
from ssdlocal.backends.torch.models.base import CausalLM, ModelArgs, read_rope
from ssdlocal.backends.torch.models.moe import ExpertArgs, MoE, Experts, TopKSoftmax
from ssdlocal.backends.torch.models.layers import Attention, PreNormBlock, RMSNorm
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import unsupported

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the tables transformers' gpt-oss applies whole


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation of (gate, up) [M, I] each, in transformers' order of ops."""

    alpha: float
    limit: float

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(min=None, max=self.limit)  # [M, I]
        up = up.clamp(min=-self.limit, max=self.limit)  # [M, I]
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [M, I]


@dataclass(frozen=True)
class GptOssArgs(ExpertArgs, ModelArgs):
    qkv_bias: bool = True
    o_bias: bool = True
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> GptOssArgs:
        arch = described.name
        types = tuple(cfg.layer_types)
        for kind in types:
            if kind not in (SLIDING, FULL):
                raise unsupported(f"{arch} with layer type {kind!r}")
        quantized = getattr(cfg, "quantization_config", None) or {}
        method = (
            quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
        )
        if method not in (None, "mxfp4"):  # MXFP4 experts are dequantized as they load (backends/torch/packed.py)
            raise unsupported(f"{arch} with quantization_config.quant_method={method!r}")
        theta, scaling = read_rope(None, cfg, arch, ROPE_TYPES)
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
        if partial not in (None, 1.0):  # transformers' gpt-oss rotates every dimension
            raise unsupported(f"{arch} with partial_rotary_factor={partial!r}")
        if scaling and scaling["rope_type"] == "yarn" and scaling.get("factor") is None:  # as transformers infers it
            scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
        qkv_bias, o_bias = described.biases(bool(getattr(cfg, "attention_bias", True)))
        return cls(
            **common_fields(cfg, arch, (theta, scaling), tie=False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=getattr(cfg, "sliding_window", None) if SLIDING in types else None,
            layer_types=types,
            **ExpertArgs.read(cfg, described),
            swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
        )

    @property
    def window(self) -> int | None:
        return self.sliding_window


def gpt_oss_norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps, scale_in_float=True)


class GptOssBlock(PreNormBlock):
    """x + attn(norm(x)), then + moe(norm(x))."""

    def __init__(self, args: GptOssArgs, kind: str) -> None:
        super().__init__()
        h, a = args.hidden_size, args
        self.self_attn = Attention.of(
            a,
            qkv_bias=a.qkv_bias,
            o_bias=a.o_bias,
            window=a.sliding_window if kind == SLIDING else None,
            sinks=True,
        )
        router = TopKSoftmax(h, a.num_experts, a.experts_per_token)
        gate = ClampedSwiGLU(a.swiglu_alpha, a.swiglu_limit)
        self.mlp = MoE(router, Experts(a.num_experts, h, a.intermediate_size, bias=True, gate_fn=gate), "router")
        self.input_layernorm = gpt_oss_norm(h, a.rms_norm_eps)
        self.post_attention_layernorm = gpt_oss_norm(h, a.rms_norm_eps)


class GptOss(CausalLM):
    args: GptOssArgs
    norm_type = staticmethod(gpt_oss_norm)

    def make_layer(self, index: int) -> nn.Module:
        return GptOssBlock(self.args, self.args.layer_types[index])
