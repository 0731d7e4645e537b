"""The llama family: Llama 3.x (SmolLM2 too), Qwen2/2.5 and Qwen3 dense models.

Pre-norm decoder layers of attention (grouped-query; biases on q/k/v for Qwen2, per-head
q/k norms for Qwen3, as the architecture's description says) and a SiLU-gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ssdlocal.backends.torch.models.fields import common_fields
from ssdlocal.backends.torch.models.base import CausalLM, ModelArgs, read_rope, refuse
from ssdlocal.backends.torch.models.layers import MLP, Attention, PreNormBlock, RMSNorm
from ssdlocal.weights.formats.arch import Architecture


@dataclass(frozen=True)
class LlamaArgs(ModelArgs):
    qkv_bias: bool = False  # qwen2: True
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k before RoPE
    o_bias: bool = False  # llama/qwen3 with attention_bias=True also bias o_proj

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> LlamaArgs:
        arch = described.name
        refuse(arch, cfg, hidden_act="silu", mlp_bias=False, use_sliding_window=False)
        theta, scaling = read_rope(None, cfg, arch)
        qkv_bias, o_bias = described.biases(bool(getattr(cfg, "attention_bias", False)))
        return cls(
            **common_fields(cfg, arch, (theta, scaling), tie=False),
            qkv_bias=qkv_bias,
            qk_norm=described.qk_norm,
            o_bias=o_bias,
        )


def llama_attention(args: LlamaArgs) -> Attention:
    norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
    return Attention.of(
        args,
        qkv_bias=args.qkv_bias,
        o_bias=args.o_bias,
        qk_norm=norm,
    )


class LlamaBlock(PreNormBlock):
    """x + attn(norm(x)), then + mlp(norm(x)); `mlp` any module over [B, T, hidden]."""

    def __init__(self, args: LlamaArgs, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = llama_attention(args)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Llama(CausalLM):
    """Llama / Qwen2 / Qwen3 dense."""

    args: LlamaArgs

    def make_layer(self, index: int) -> nn.Module:
        return LlamaBlock(self.args, MLP(self.args.hidden_size, self.args.intermediate_size))
