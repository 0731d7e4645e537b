"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms) with a
mixture-of-experts feed-forward in every sparse layer: softmax routing over `num_experts`,
the top `num_experts_per_tok` (renormalised when `norm_topk_prob`), SiLU-gated experts of
width `moe_intermediate_size`, no shared expert. Layers listed in `mlp_only_layers`, or off
the `decoder_sparse_step`, keep a dense MLP of width `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ssdlocal.backends.torch.models.layers import MLP
from ssdlocal.backends.torch.models.llama import Llama, LlamaArgs, LlamaBlock
from ssdlocal.backends.torch.models.moe import ExpertArgs, MoE, Experts, SoftmaxTopK
from ssdlocal.weights.formats.arch import Architecture


@dataclass(frozen=True)
class Qwen3MoeArgs(ExpertArgs, LlamaArgs):
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()  # the layers whose feed-forward is the MoE

    @classmethod
    def from_hf_config(cls, cfg, described: Architecture) -> Qwen3MoeArgs:
        dense = LlamaArgs.from_hf_config(cfg, described)
        experts = ExpertArgs.read(cfg, described)
        moe = experts["num_experts"] > 0
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        only_dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in range(dense.num_layers) if moe and i not in only_dense and (i + 1) % step == 0)
        return cls(
            **{f: getattr(dense, f) for f in dense.__dataclass_fields__},
            **experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            sparse_layers=sparse,
        )

    @property
    def tensor_parallel_sizes(self) -> tuple[tuple[str, int], ...]:
        return (*super().tensor_parallel_sizes, ("moe_intermediate_size", self.moe_intermediate_size))


class Qwen3Moe(Llama):
    """Qwen3 dense layers with the MoE feed-forward in the sparse ones."""

    args: Qwen3MoeArgs

    def make_layer(self, index: int) -> nn.Module:
        a = self.args
        if index not in a.sparse_layers:
            return LlamaBlock(a, MLP(a.hidden_size, a.intermediate_size))
        router = SoftmaxTopK(a.hidden_size, a.num_experts, a.experts_per_token, a.norm_topk_prob)
        return LlamaBlock(a, MoE(router, Experts(a.num_experts, a.hidden_size, a.moe_intermediate_size)))
