"""Mixture-of-experts feed-forward: a router picks top-k experts per token, each expert is a
gated MLP, the token's output is their weighted sum.

Experts are stacked (`StackedLinear`: [E, out, in] per projection) and run as grouped
matrix multiplications (`torch._grouped_mm`): the N tokens' N*k (token, expert) slots are
sorted by expert on the device, each expert multiplies its contiguous run, and the results
go back to their slots. Shapes never depend on the routing and nothing is read back to the
host, so a decode or verify step of a MoE model is one captured graph. A token's output
sums its slots in the router's order, whatever the batch holds.

Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj.weight`) or stacked; the
loaders stack them (`stack_experts`). Shapes: N tokens, k experts per token, E experts,
H hidden, I expert width.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Gate = Callable[[Tensor, Tensor], Tensor]  # (gate, up) [M, I] each -> the expert's activation [M, I]


@dataclass(frozen=True)
class ExpertArgs:
    """What the args of a family with routed experts add (a base listed before its
    ModelArgs): E experts, k of them per token (0: none, a dense model of the family)."""

    num_experts: int = 0
    experts_per_token: int = 0

    @classmethod
    def read(cls, cfg, described) -> dict[str, int]:
        """These fields (by name, for a family's args) from a transformers config, named as
        the architecture's description says (Architecture.expert_keys, which
        weights/size.py reads too): the first expert count it sets, and the experts per
        token where it has experts."""
        counts, per_token = described.expert_keys
        experts = next((getattr(cfg, key) for key in counts if getattr(cfg, key, None)), 0)
        return asdict(cls(experts, getattr(cfg, per_token) if experts else 0))


def silu_gate(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up  # [M, I]


class StackedLinear(nn.Module):
    """E linears of one shape: weight [E, out, in], bias [E, out] or None."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(experts, out_features)) if bias else None

    def grouped(self, x: Tensor, ends: Tensor, experts: Tensor, bias: bool = True) -> Tensor:
        """x [M, in] sorted by expert, `ends` [E] int32 each expert's run end, `experts` [M]
        each row's expert -> [M, out] (`bias=False`: without the bias)."""
        y = torch._grouped_mm(x, self.weight.transpose(1, 2), offs=ends)  # [M, out]
        return y if self.bias is None or not bias else y + self.bias[experts]


class Experts(nn.Module):
    """E gated MLPs, stacked: gate/up [E, I, H], down [E, H, I]; `gate_fn(gate, up)` the
    activation (SiLU-gated by default)."""

    def __init__(self, experts: int, hidden: int, width: int, *, bias: bool = False, gate_fn: Gate = silu_gate):
        super().__init__()
        self.num_experts = experts
        self.gate_proj = StackedLinear(experts, hidden, width, bias)
        self.up_proj = StackedLinear(experts, hidden, width, bias)
        self.down_proj = StackedLinear(experts, width, hidden, bias)
        self.gate_fn = gate_fn

    def forward(self, x: Tensor, index: Tensor, weights: Tensor, partial: bool = False) -> Tensor:
        """x [N, H], index [N, k] (experts), weights [N, k] -> [N, H]. `partial`: this rank's
        share of a width split over ranks, without the down projection's bias (`routed_bias`
        adds it once after the ranks' sum)."""
        n, k = index.shape
        flat = index.reshape(-1)  # [N*k]
        order = flat.argsort(stable=True)  # [N*k]: slots grouped by expert
        experts = flat[order]  # [N*k]
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E] (static shape)
        ends = counts.cumsum(0, dtype=torch.int32)  # [E]
        xs = x[order // k]  # [N*k, H]: each sorted slot's token
        act = self.gate_fn(self.gate_proj.grouped(xs, ends, experts), self.up_proj.grouped(xs, ends, experts))
        y = self.down_proj.grouped(act, ends, experts, bias=not partial)  # [N*k, H]
        slots = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)  # [N, k, H] back in slot order
        out = slots[:, 0] * weights[:, :1]  # [N, H]
        for s in range(1, k):  # the router's order, the same in every batch
            out = out + slots[:, s] * weights[:, s : s + 1]
        return out

    def routed_bias(self, index: Tensor, weights: Tensor) -> Tensor | None:
        """The down projection's bias of each token's experts, weighted as their outputs:
        index/weights [N, k] -> [N, H] (None: no bias)."""
        bias = self.down_proj.bias
        if bias is None:
            return None
        picked = bias[index]  # [N, k, H]
        out = picked[:, 0] * weights[:, :1]  # [N, H]
        for s in range(1, index.shape[1]):
            out = out + picked[:, s] * weights[:, s : s + 1]
        return out


class SoftmaxTopK(nn.Module):
    """Qwen-MoE routing: softmax over every expert (float32), the top k, renormalised to
    sum to one when `normalize`; weights in the activation dtype."""

    def __init__(self, hidden: int, experts: int, k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.k, self.normalize = k, normalize

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k], experts [N, k])."""
        logits = F.linear(x, self.weight)  # [N, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
        top, index = torch.topk(probs, self.k, dim=-1)  # [N, k] each
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), index


class TopKSoftmax(nn.Module):
    """gpt-oss routing: the top k router logits (with a bias), softmax over those k."""

    def __init__(self, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts))
        self.k = k

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [N, E]
        top, index = torch.topk(logits, self.k, dim=-1)  # [N, k] each
        return F.softmax(top, dim=-1, dtype=top.dtype), index


class MoE(nn.Module):
    """A router (its module name is the family's: `gate`, `router`) and the experts; under
    tensor parallelism every rank routes alike and holds a slice of every expert's width,
    the partial outputs are summed across ranks (`group`, set by parallel/tp.py) and the
    down projection's bias (gpt-oss), which every rank holds whole, is added once after."""

    def __init__(self, router: nn.Module, experts: Experts, router_name: str = "gate") -> None:
        super().__init__()
        self.router_name = router_name
        self.add_module(router_name, router)
        self.experts = experts
        self.group = None  # a process group: outputs are partial sums (parallel/tp.py)

    def forward(self, x: Tensor) -> Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)  # [N, H]
        weights, index = getattr(self, self.router_name)(flat)  # [N, k] each
        out = self.experts(flat, index, weights, partial=self.group is not None)  # [N, H]
        if self.group is not None:
            import torch.distributed._functional_collectives as funcol

            out = funcol.all_reduce(out, "sum", self.group)
            bias = self.experts.routed_bias(index, weights)  # [N, H] or None
            out = out if bias is None else out + bias
        return out.reshape(B, T, H)


_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.(weight|bias)")


def stack_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint tensors of one expert each (`...experts.{e}.gate_proj.weight`) -> stacked
    ones (`...experts.gate_proj.weight` [E, ...]); every other tensor as it is. Each stack
    is built as its last expert arrives and the single ones are freed with it."""
    groups: dict[tuple[str, str, str], dict[int, Tensor]] = {}
    out: dict[str, Tensor] = {}
    for name in list(state):
        found = _PER_EXPERT.fullmatch(name)
        if found is None:
            out[name] = state.pop(name)
            continue
        prefix, e, proj, leaf = found.groups()
        groups.setdefault((prefix, proj, leaf), {})[int(e)] = state.pop(name)
    for (prefix, proj, leaf), parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            missing = sorted(set(range(max(parts) + 1)) - set(parts))
            raise KeyError(f"{prefix}: experts {missing} of {proj}.{leaf} are missing")
        out[f"{prefix}.{proj}.{leaf}"] = torch.stack([parts.pop(e) for e in range(len(parts))])
    return out
