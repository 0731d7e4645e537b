"""What a decode step reads besides its inputs: the per-row state (`DecodeState`) and the
span buckets its attention is captured for (`bucket_span`). Knows nothing about models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.backends.torch.kvcache import SLOT_ROUNDING


class DecodeState:
    """Per-row `lengths` [B] and token `offsets` [STEP_OFFSETS] long, on the device, and
    when a drafter reads hidden states (`TorchRunner.keep_hidden`) the buffer steps write
    them into, `hidden` [B, STEP_OFFSETS, width] (else None).

    Captured steps read and write these at fixed addresses, so they change only in place
    (`copy_`, `+=`); rebinding an attribute raises. Sized for every row of the KV cache (B
    there is the cache's rows; a batch uses its first rows): a cache of more rows gets a new
    DecodeState (and the runner drops its graphs)."""

    __slots__ = ("lengths", "offsets", "hidden")

    def __init__(
        self, batch: int, width: int, device: torch.device, hidden: int = 0, dtype: torch.dtype | None = None
    ) -> None:
        object.__setattr__(self, "lengths", torch.zeros(batch, dtype=torch.long, device=device))
        object.__setattr__(self, "offsets", torch.arange(width, device=device))
        states = torch.zeros(batch, width, hidden, dtype=dtype, device=device) if hidden else None
        object.__setattr__(self, "hidden", states)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the state (what captured steps may read or write)."""
        return (self.lengths, self.offsets) if self.hidden is None else (self.lengths, self.offsets, self.hidden)

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, name, None) is value:  # `state.lengths += n` rebinds the same tensor
            return
        raise AttributeError(f"DecodeState.{name} is read by captured steps: update it in place")


SPAN_STEPS = 8  # span buckets per doubling of the span


def bucket_span(span: int) -> int:
    """The slots a captured step attends over: `span` rounded up to a multiple of an
    eighth of the largest power of two below it, at least 256 (multiples of 256 up to
    4,096 slots, of 512 up to 8,192, of 1,024 up to 16,384, ...). A step reads at most
    1/8 more slots than it needs (or 255), where powers of two read up to 2x; spans up to
    N slots give 16 shapes up to 4,096 and 8 per doubling past it (40 up to 32,768), per
    (batch, tokens) of a step, and one generation only meets the few its lengths cross."""
    if span <= SLOT_ROUNDING:
        return SLOT_ROUNDING
    octave = 1 << (span - 1).bit_length() - 1  # the largest power of two below span
    step = max(SLOT_ROUNDING, octave // SPAN_STEPS)
    return -(-span // step) * step
