"""Quantized weights put into a model from outside its code: `quantize_model` swaps a loaded
model's quantized linears for QuantLinears (as parallel/tp.py swaps them for shards),
`QuantEmbedding` keeps a GGUF's quantized embedding as codes, and `model_bytes` sizes what a
model holds. The weights' own form and kernels are quant.py's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.models.moe import StackedLinear
from ssdlocal.backends.torch.quant import QuantizedWeight, QuantLinear, quantize
from ssdlocal.backends.torch.quant_experts import quantize_stacked
from ssdlocal.core.quantization import Quantization, can_quantize
from ssdlocal.weights.formats.archs import architecture


class QuantEmbedding(nn.Module):
    """A token embedding kept as int8 / int4 codes (a GGUF's embedding is quantized
    already); a lookup de-quantizes only the rows it gathers, in float32, then `dtype`."""

    def __init__(self, weight: QuantizedWeight, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.scheme, self.group_size, self.dtype = weight.scheme, weight.group_size, dtype
        self.register_buffer("codes", weight.codes.to(device))
        self.register_buffer("scales", weight.scales.to(device))  # kept as stored: float32 math
        self.register_buffer("zeros", None if weight.zeros is None else weight.zeros.to(device))

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)  # [B*T]
        zeros = None if self.zeros is None else self.zeros[flat]
        rows = QuantizedWeight(self.scheme, self.codes[flat], self.scales[flat], zeros, self.group_size)
        return rows.dequantize(self.dtype).view(*ids.shape, self.embedding_dim)  # [B, T, hidden]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.scheme}"


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def replace_linear(
    model: nn.Module, name: str, old: nn.Module, weight: QuantizedWeight, bias: Tensor | None, dtype, device
) -> None:
    """Linear `name` (`old`) -> a QuantLinear of `weight`; a row-parallel shard's (one with
    a `group`, see parallel/tp.py) keeps its group and its all_reduce."""
    group = getattr(old, "group", None)
    quantized = QuantLinear(weight, bias, dtype=dtype, device=device, reduce=hasattr(old, "group"), group=group)
    replace_module(model, name, quantized)


def quantize_model(model: nn.Module, scheme: Quantization) -> nn.Module:
    """Swap the quantized linears of a loaded model (its architecture's) for QuantLinears, in place.

    Row-parallel shards (modules with a `group`, see parallel/tp.py) keep their all_reduce.
    A tied lm_head gets its own codes; the embedding it shared stays as it was. Weights are
    quantized on their own device (separate elementwise float32 steps, each correctly
    rounded on either device, so the CPU's codes; a GPU's in seconds).
    """
    if scheme == Quantization.NONE:
        return model
    arch = architecture(model.args.arch)
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not arch.quantized(name) or weight is None or not can_quantize(tuple(weight.shape), scheme):
            continue
        if isinstance(module, StackedLinear):  # a MoE layer's experts, each quantized alone
            replace_module(model, name, quantize_stacked(module, scheme))
            continue
        qw = quantize(weight.detach(), scheme, weight.dtype)  # where the weight is: a GPU's in seconds
        bias = None if module.bias is None else module.bias.detach()
        replace_linear(model, name, module, qw, bias, weight.dtype, weight.device)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
