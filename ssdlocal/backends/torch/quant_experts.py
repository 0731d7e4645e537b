"""Experts as int8 / int4 codes: the stacked linears of a mixture-of-experts layer
(models.moe.StackedLinear) with every expert quantized as a Linear is (quant.QuantizedWeight
layouts, stacked [E, ...]), kept device-neutral and dequantized where they are used.

A step with few (token, expert) rows dequantizes only the experts those rows use, one per
row, and multiplies row by row; a long feed dequantizes every expert once and runs the
grouped multiplication the float experts run. Either way the shapes follow the number of
rows only: a captured step replays. The float32 arithmetic is QuantizedWeight.dequantize's,
so a quantized model equals the same model with its experts dequantized.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.models.moe import StackedLinear
from ssdlocal.backends.torch.quant import QuantizedWeight
from ssdlocal.core.quantization import Quantization


class QuantStacked(nn.Module):
    """E quantized linears of one shape; `grouped` as StackedLinear's."""

    def __init__(self, weights: list[QuantizedWeight], bias: Tensor | None, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        first = weights[0]
        self.scheme, self.group_size, self.dtype = first.scheme, first.group_size, dtype
        self.out_features, self.in_features = first.shape
        self.register_buffer("codes", torch.stack([w.codes for w in weights]).to(device))  # [E, N, K or K/2]
        self.register_buffer("scales", torch.stack([w.scales for w in weights]).to(device))  # [E, N(, G)]
        zeros = None if first.zeros is None else torch.stack([w.zeros for w in weights]).to(device)
        self.register_buffer("zeros", zeros)  # [E, N, G] (int4)
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    def dequantized(self, index: Tensor | None = None) -> Tensor:
        """The weights [n, N, K] in the activation dtype of experts `index` [n] (None: all),
        computed in float32 as QuantizedWeight.dequantize computes them."""
        codes = self.codes if index is None else self.codes[index]
        scales = self.scales if index is None else self.scales[index]
        if self.scheme is Quantization.INT8:
            return (codes.float() * scales.float()[..., None]).to(self.dtype)  # [n, N, K]
        zeros = self.zeros if index is None else self.zeros[index]
        n, rows, half = codes.shape
        q = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(n, rows, half * 2).float()  # [n, N, K]
        g = self.group_size
        w = (q.view(n, rows, -1, g) - 8) * scales.float()[..., None] + zeros.float()[..., None]  # [n, N, G, g]
        return w.view(n, rows, half * 2).to(self.dtype)  # [n, N, K]

    def grouped(self, x: Tensor, ends: Tensor, experts: Tensor, bias: bool = True) -> Tensor:
        """x [M, in] sorted by expert, `ends` [E] int32, `experts` [M] -> [M, out] (`bias=False`:
        without the bias)."""
        if x.shape[0] <= self.num_experts:  # few rows: only the experts they use
            y = torch.bmm(self.dequantized(experts), x[:, :, None])[..., 0]  # [M, out]
        else:  # a long feed: every expert once, grouped as the float experts run
            y = torch._grouped_mm(x, self.dequantized().transpose(1, 2), offs=ends)  # [M, out]
        return y if self.bias is None or not bias else y + self.bias[experts]

    def extra_repr(self) -> str:
        return f"{self.num_experts} x ({self.in_features} -> {self.out_features}), {self.scheme}"


def quantize_stacked(module: StackedLinear, scheme: Quantization) -> QuantStacked:
    """`module`'s experts quantized one by one (quant.quantize), as a loaded model's."""
    from ssdlocal.backends.torch.quant import quantize

    weight = module.weight.detach()
    parts = [quantize(weight[e].cpu(), scheme, weight.dtype) for e in range(weight.shape[0])]
    bias = None if module.bias is None else module.bias.detach()
    return QuantStacked(parts, bias, dtype=weight.dtype, device=weight.device)
