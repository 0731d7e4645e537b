"""Float32 logits from a bf16/fp16 model, so rounding of the output never decides a token.

A bf16 lm_head rounds each logit to 8 significant bits: two candidates whose true values
differ can come out equal, and the argmax then depends on which kernel shape (1 token or
K+1 tokens) computed them. On CUDA the matmul accumulates and returns float32 directly;
on the CPU (no such kernel in torch) the bf16 logits are computed as usual and the few
best candidates per position are recomputed in float32, which is where ties matter.
A quantized lm_head (QuantLinear) is refined the same way, from its de-quantized rows
(int8 on CUDA too; tinygemm's int4 layout is not read, so there the logits keep the
activation dtype's rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.quant import QuantLinear

REFINED = 8  # candidates per position recomputed in float32 on the CPU


def fp32_logits(head: nn.Module, h: Tensor) -> Tensor:
    """head (the lm_head), h [B, T, hidden] -> logits [B, T, V] float32."""
    if h.dtype == torch.float32 or not isinstance(head, nn.Linear | QuantLinear):
        return head(h).float()  # already exact (or a TP rank's Identity head)
    if isinstance(head, QuantLinear):
        return refine_top(head(h).float(), h, head.dequantize_rows, head.bias)
    if h.is_cuda:
        exact = _cuda_fp32_linear(head, h)
        if exact is not None:
            return exact
    return refine_top(head(h).float(), h, lambda top: head.weight[top].float(), head.bias)


def _cuda_fp32_linear(head: nn.Linear, h: Tensor) -> Tensor | None:
    """bf16 inputs, float32 accumulation and output; None if this build lacks the kernel."""
    flat = h.reshape(-1, h.shape[-1])  # [N, hidden]
    try:
        out = torch.mm(flat, head.weight.t(), out_dtype=torch.float32)  # [N, V]
    except (RuntimeError, TypeError):
        return None
    if head.bias is not None:
        out += head.bias.float()
    return out.view(*h.shape[:-1], -1)  # [B, T, V]


def refine_top(logits: Tensor, h: Tensor, rows_of: Callable[[Tensor], Tensor | None], bias: Tensor | None) -> Tensor:
    """Replace the REFINED largest logits of each position by float32 recomputations.

    logits [B, T, V] float32 (rounded values), h [B, T, hidden]; rows_of(top [B, T, R])
    gives those rows of the weight as float32 [B, T, R, hidden], or None (logits kept).
    """
    top = logits.topk(min(REFINED, logits.shape[-1]), dim=-1).indices  # [B, T, R]
    rows = rows_of(top)  # [B, T, R, hidden]
    if rows is None:
        return logits
    exact = (rows @ h.float().unsqueeze(-1)).squeeze(-1)  # [B, T, R]
    if bias is not None:
        exact = exact + bias.float()[top]  # [B, T, R]
    return logits.scatter_(-1, top, exact)  # [B, T, V]
