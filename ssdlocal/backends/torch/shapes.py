"""The shapes a captured decode step is keyed by, and the per-row state it reads.

A graph replays one shape, so the runner maps every step onto few of them: batch rows
padded up to a bucket (graphs.BUCKETS) of the rows its KV cache was sized for, a draft's
catch-up widths padded to the same buckets, and attention spans rounded to eighths of a
doubling (`bucket_span`). `DecodeState` holds the per-row lengths and token offsets a
step reads, sized once for the cache's rows and changed only in place. Padded rows and
columns compute garbage nobody reads: a padded row is a cache row no request holds (its
length stays 0, so it attends to its own first slots), a padded column writes slots past
its row's length, which later steps overwrite. Knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssdlocal.backends.torch.graphs import bucket
from ssdlocal.backends.torch.kvcache import SLOT_ROUNDING

SPAN_STEPS = 8  # span buckets per doubling of the span


class DecodeState:
    """Per-row `lengths` [rows] and token `offsets` [width] long, on the device.

    Captured steps read these at fixed addresses, so they change only in place (`copy_`,
    `+=`); rebinding an attribute raises. Sized for every row of the KV cache (a batch uses
    its first rows); a cache of more rows gets a new DecodeState (and the runner drops its
    graphs)."""

    __slots__ = ("lengths", "offsets")

    def __init__(self, batch: int, width: int, device: torch.device) -> None:
        object.__setattr__(self, "lengths", torch.zeros(batch, dtype=torch.long, device=device))
        object.__setattr__(self, "offsets", torch.arange(width, device=device))

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, name, None) is value:  # `state.lengths += n` rebinds the same tensor
            return
        raise AttributeError(f"DecodeState.{name} is read by captured steps: update it in place")


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


def padded(t: Tensor, rows: int, width: int | None = None) -> Tensor:
    """t [B, T, ...] (or [B]) padded with zeros to [rows, width, ...] on its device (no host read)."""
    if t.dim() == 1:
        return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0])])
    B, T = t.shape[:2]
    width = T if width is None else width
    if (B, T) == (rows, width):
        return t
    out = t.new_zeros((rows, width, *t.shape[2:]))  # [rows, width, ...]
    out[:B, :T] = t
    return out


def padded_tree_mask(mask: Tensor, rows: int) -> Tensor:
    """mask [B, W, S] bool padded to [rows, W, S]: a padded row's queries see slot 0 only
    (a query that sees no slot would turn into NaN)."""
    B = mask.shape[0]
    if B == rows:
        return mask
    pad = torch.zeros((rows - B, *mask.shape[1:]), dtype=torch.bool, device=mask.device)  # [rows - B, W, S]
    pad[..., 0] = True
    return torch.cat([mask, pad])


def warm_steps(runner, batch_size: int, widths: Sequence[int], at_widths: Sequence[int] = ()) -> int:
    """Size a torch runner's KV cache for `batch_size` rows and capture, for every batch
    bucket up to it, its steps of each of `widths` tokens and its steps `at` one column of
    each of `at_widths` (a draft's catch-up), over the first span bucket; each shape runs
    twice (capture, then a replay and its self-check). Returns the graphs captured. The
    rows hold nothing afterwards (as after `reset`)."""
    before = runner.graphs.stats.captured
    slots = max(runner.num_slots, bucket_span(1))
    runner.reset(batch_size, slots)  # the cache's rows first: smaller batches use its first rows
    device = runner.device
    for rows in sorted({bucket(n) for n in range(1, batch_size + 1)}):
        runner.reset(rows, slots)
        runner.begin_steps()
        for width in widths:
            for _ in range(2):
                runner.step(torch.zeros(rows, width, dtype=torch.long, device=device), width)
        for width in at_widths:
            at = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
            for _ in range(2):
                runner.step(torch.zeros(rows, width, dtype=torch.long, device=device), bucket(width), at=at)
    runner.reset(batch_size, slots)
    return runner.graphs.stats.captured - before
