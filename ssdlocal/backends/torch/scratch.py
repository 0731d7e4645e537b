"""Scratch tensors lent out and given back, so a loop over layers reuses one layer's buffers.

A long prefill expands each layer's quantized weights into dense ones; allocating them
anew for every layer costs page faults (and, for large matrices, fresh memory maps) each
time. A ScratchPool lives for one prefill: a buffer given back is lent again to the next
request of its shape, dtype and device. Knows nothing about models.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ScratchPool:
    def __init__(self) -> None:
        self._free: dict[tuple, list[Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor of this shape (one given back earlier, or a new one)."""
        free = self._free.get((tuple(shape), dtype, torch.device(device)))
        return free.pop() if free else torch.empty(shape, dtype=dtype, device=device)

    def give(self, tensor: Tensor) -> None:
        """`tensor` (from `take`) may be lent again; the caller no longer reads it."""
        self._free.setdefault((tuple(tensor.shape), tensor.dtype, tensor.device), []).append(tensor)
