"""Tensor parallelism applied to a loaded model from outside the model code (gpt-fast tp.py).

Each rank keeps 1/TP of the attention heads and of the MLP's intermediate features. How
each linear splits comes from the architecture's description (weights/formats/arch.py):
for the llama family q/k/v and gate/up column-wise (by heads for attention), o_proj and
down_proj row-wise and followed by an all_reduce. Embeddings, norms and lm_head stay
replicated, so every rank ends with the full logits. The KV cache holds only the rank's
kv heads (the model's args are replaced by per-rank head counts before `setup_cache`).
The all_reduce is torch's functional collective (as in gpt-fast): an op with an output,
so a traced step (SSDLOCAL_GRAPHS=trace, over gloo) records it in its op graph and a CUDA
graph records it as an NCCL kernel; every replay then reduces again with the other ranks.
Knows nothing about processes: it only needs a rank, a world size and a process group.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F
from torch import Tensor, nn

from ssdlocal.backends.torch.models.moe import MoE, StackedLinear
from ssdlocal.backends.torch.quant_apply import replace_module
from ssdlocal.core.errors import UsageError
from ssdlocal.weights.formats.archs import architecture


class RowParallelLinear(nn.Module):
    """The rank's column slice of a Linear's weight; partial outputs are summed over ranks.

    The bias (if any) is added once, after the all_reduce, so no rank adds it twice.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / TP]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        out = F.linear(x, self.weight)  # [..., out] partial sum of this rank's features
        out = funcol.all_reduce(out, "sum", self.group or dist.group.WORLD)  # [..., out] full sum
        return out if self.bias is None else out + self.bias


def check_divisible(sizes: tuple[tuple[str, int], ...], tp: int) -> None:
    """Raise UsageError unless every (name, size) tensor parallelism divides (a model's
    heads, kv heads, MLP and expert widths: ModelArgs.tensor_parallel_sizes) splits evenly
    over `tp` ranks."""
    bad = [f"{name}={value}" for name, value in sizes if value % tp]
    if tp < 1 or bad:
        raise UsageError(
            f"tensor parallelism over {tp} devices needs {', '.join(bad) or 'tp >= 1'} divisible by {tp}",
            "use a number of target devices that divides the model's head counts (`ssdlocal devices` picks one)",
        )


def _rows(t: Tensor, rank: int, tp: int) -> Tensor:
    """Rank's contiguous slice of dim 0 (output features of a Linear)."""
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n].contiguous()


def _cols(t: Tensor, rank: int, tp: int) -> Tensor:
    """Rank's contiguous slice of dim 1 (input features of a Linear)."""
    n = t.shape[1] // tp
    return t[:, rank * n : (rank + 1) * n].contiguous()


def _shard_columns(linear: nn.Linear, rank: int, tp: int) -> None:
    """Keep the rank's output features (whole heads when the features are heads x D)."""
    linear.weight = nn.Parameter(_rows(linear.weight.data, rank, tp), requires_grad=False)  # [out/TP, in]
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias.data, rank, tp), requires_grad=False)  # [out/TP]
    linear.out_features //= tp


def _row_parallel(linear: nn.Linear, rank: int, tp: int, group) -> RowParallelLinear:
    bias = None if linear.bias is None else linear.bias.data
    return RowParallelLinear(_cols(linear.weight.data, rank, tp), bias, group)


def apply_tensor_parallel(model: nn.Module, rank: int, tp: int, group=None) -> nn.Module:
    """Shard a loaded model in place for `rank` of `tp`; returns the same model.

    Contiguous head blocks per rank keep grouped-query attention intact: with
    rep = H / Hkv, the rank's q heads [r*H/TP, (r+1)*H/TP) use exactly its kv heads
    [r*Hkv/TP, (r+1)*Hkv/TP). Call before `setup_cache`; `model.args` then carries the
    per-rank head counts so the cache is [B, Hkv/TP, N, D].
    """
    args = model.args
    check_divisible(args.tensor_parallel_sizes, tp)
    if tp == 1:
        return model
    linears = architecture(args.arch).linears
    for layer in model.layers:
        for name, linear in linears.items():
            if "{e}" in name or not _has(layer, name):  # one expert each: stacked in the model
                continue
            module = layer.get_submodule(name)
            if isinstance(module, StackedLinear):
                _shard_stacked(module, linear.split, rank, tp)
            elif linear.split == "column":
                _shard_columns(module, rank, tp)
            elif linear.split == "row":
                replace_module(layer, name, _row_parallel(module, rank, tp, group))
        for module in layer.modules():
            if isinstance(module, MoE):  # its experts' outputs are partial sums now
                module.group = group or _world()
        layer.self_attn.n_heads //= tp
        layer.self_attn.n_kv_heads //= tp
        if layer.self_attn.sinks is not None:  # one sink per query head: the rank's heads
            layer.self_attn.sinks = nn.Parameter(_rows(layer.self_attn.sinks.data, rank, tp), requires_grad=False)
    model.args = replace(args, **{name: value // tp for name, value in args.tensor_parallel_sizes})
    model.tp_rank, model.tp_size = rank, tp
    return model


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:  # e.g. a dense layer of a MoE model has no experts
        return False
    return True


def _world():
    import torch.distributed as dist

    return dist.group.WORLD


def _shard_stacked(experts: StackedLinear, split: str, rank: int, tp: int) -> None:
    """Every expert keeps the rank's slice: output features (column: weight [E, out/TP, in],
    bias [E, out/TP]) or input features (row: weight [E, out, in/TP]; the MoE sums the
    partial outputs over the ranks, a bias is not expected on a row split here)."""
    weight = experts.weight.data
    n = weight.shape[1 if split == "column" else 2] // tp
    dim = 1 if split == "column" else 2
    experts.weight = nn.Parameter(weight.narrow(dim, rank * n, n).contiguous(), requires_grad=False)
    if experts.bias is not None and split == "column":
        experts.bias = nn.Parameter(experts.bias.data.narrow(1, rank * n, n).contiguous(), requires_grad=False)
    elif experts.bias is not None:
        raise UsageError(
            "tensor parallelism over experts whose down projection has a bias is not implemented",
            "run this model on one device",
        )


def shard_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (shared tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


__all__ = ["RowParallelLinear", "apply_tensor_parallel", "check_divisible", "shard_bytes"]
