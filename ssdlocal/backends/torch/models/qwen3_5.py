"""Qwen3.5 (`Qwen3_5ForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`): hybrid stacks in
which most layers are Gated DeltaNet linear attention (deltanet.py; states kept by
hybrid.py) and every few (`layer_types`, usually one in four) full attention with per-head
q/k norms, rotary positions on the first `partial_rotary_factor` of each head and an output
gate (q_proj gives each head its query and its gate; the output is times sigmoid(gate)).
Norms are zero-centred (scale 1 + weight, applied in float32). The dense family has a SiLU
MLP in every layer; the MoE family a softmax top-k router (renormalised), SiLU experts and
a shared expert scaled by sigmoid(shared_expert_gate(x)), in every layer.
Text only: a multimodal config's rotary sections see one position per token (text), where
they equal plain rotary positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.attention import AttentionMask, attend
from ssdlocal.backends.torch.models.base import ModelArgs, read_rope, refuse
from ssdlocal.backends.torch.models.fields import common_fields
from ssdlocal.backends.torch.models.deltanet import GatedDeltaNet
from ssdlocal.backends.torch.models.hybrid import HybridBlock, HybridLM
from ssdlocal.backends.torch.models.layers import MLP, Attention, RMSNorm, apply_rope
from ssdlocal.backends.torch.models.moe import ExpertArgs, MoE, Experts, SoftmaxTopK
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import unsupported

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3_5Args(ExpertArgs, ModelArgs):
    linear: tuple[int, ...] = ()  # the layers that are linear attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 4
    rotary_dim: int = 0  # the rotated share of each attention head
    moe_intermediate_size: int = 0  # MoE only, from here on (and ExpertArgs)
    shared_expert_size: int = 0

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> Qwen3_5Args:
        arch = described.name
        refuse(arch, cfg, hidden_act="silu", attention_bias=False, mlp_only_layers=None)
        kinds = list(getattr(cfg, "layer_types", None) or ())
        if len(kinds) != cfg.num_hidden_layers:
            raise unsupported(f"{arch} with {len(kinds)} layer_types for {cfg.num_hidden_layers} layers")
        odd = next((k for k in kinds if k not in LAYER_KINDS), None)
        if odd is not None:
            raise unsupported(f"{arch} with a layer of type {odd!r}")
        rope = read_rope(None, cfg, arch, supported=("default",))  # (theta, None)
        parameters = getattr(cfg, "rope_parameters", None) or {}
        factor = parameters.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        # the MoE family's config has no dense width
        common = common_fields(cfg, arch, rope, tie=False, intermediate_size=getattr(cfg, "intermediate_size", 0) or 0)
        experts = ExpertArgs.read(cfg, described)
        moe = experts["num_experts"] > 0
        return cls(
            **common,
            linear=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
            linear_key_heads=cfg.linear_num_key_heads,
            linear_value_heads=cfg.linear_num_value_heads,
            linear_key_dim=cfg.linear_key_head_dim,
            linear_value_dim=cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            rotary_dim=int(common["head_dim"] * factor),
            **experts,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) if moe else 0,
            shared_expert_size=getattr(cfg, "shared_expert_intermediate_size", 0) if moe else 0,
        )

    def ropes(self) -> dict[str, tuple[int, float, dict | None]]:
        return {"global": (self.rotary_dim, self.rope_theta, None)}

    @property
    def tensor_parallel_sizes(self) -> tuple[tuple[str, int], ...]:
        sizes = [("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)]
        if self.num_experts:
            sizes += [
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("shared_expert_size", self.shared_expert_size),
            ]
        else:
            sizes.append(("intermediate_size", self.intermediate_size))
        return tuple(sizes)


def zero_centred(dim: int, eps: float) -> RMSNorm:
    """Qwen3.5's RMS norm: scale (1 + weight), applied in float32."""
    return RMSNorm(dim, eps, offset=1.0, scale_in_float=True)


class GatedAttention(Attention):
    """Attention whose q_proj gives each head its query and an output gate (interleaved per
    head: [query D | gate D]); the heads' output is times sigmoid(gate) before o_proj."""

    def __init__(self, args: Qwen3_5Args) -> None:
        norm = zero_centred(args.head_dim, args.rms_norm_eps)
        super().__init__(args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, qk_norm=norm)
        self.q_proj = nn.Linear(args.hidden_size, 2 * args.num_heads * args.head_dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [B, T, H, D] each
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert self.kv_cache is not None  # setup_cache ran (CausalLM.forward checks)
        keys, values = self.kv_cache.update(slots, k, v, T if mask is None else mask.span)  # [B, Hkv, S, D] each
        out = attend(q, k, v, keys, values, mask, scale=self.scale)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))  # [B, T, H*D]
        return self.o_proj(out)  # [B, T, hidden]


def linear_attention(a: Qwen3_5Args) -> GatedDeltaNet:
    return GatedDeltaNet(
        a.hidden_size,
        a.linear_key_heads,
        a.linear_value_heads,
        a.linear_key_dim,
        a.linear_value_dim,
        a.conv_kernel,
        a.rms_norm_eps,
    )


class Qwen3_5(HybridLM):
    """Qwen3.5 dense: linear or gated full attention, then a SiLU MLP, in every layer."""

    args: Qwen3_5Args
    norm_type = staticmethod(zero_centred)

    def make_mixer(self, index: int) -> nn.Module:
        return linear_attention(self.args) if index in self.args.linear else GatedAttention(self.args)

    def make_mlp(self) -> nn.Module:
        return MLP(self.args.hidden_size, self.args.intermediate_size)

    def make_layer(self, index: int) -> nn.Module:
        return HybridBlock(self.make_mixer(index), self.make_mlp(), self.make_norm)


class SharedExpertMoE(MoE):
    """Routed experts plus a shared expert, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, a: Qwen3_5Args) -> None:
        router = SoftmaxTopK(a.hidden_size, a.num_experts, a.experts_per_token, normalize=True)
        super().__init__(router, Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size))
        self.shared_expert = MLP(a.hidden_size, a.shared_expert_size)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        routed = super().forward(x)  # [B, T, hidden]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [B, T, hidden]


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5-MoE: the dense family's mixers with the shared-expert MoE in every layer."""

    def make_mlp(self) -> nn.Module:
        return SharedExpertMoE(self.args)
