"""The shapes a captured decode step is keyed by, and the warm-up that captures them.

A graph replays one shape, so the runner maps every step onto few of them: batch rows
padded up to a bucket (graphs.BUCKETS) of the rows its KV cache was sized for, a draft's
catch-up widths padded to the same buckets, and attention spans rounded to eighths of a
doubling (decode_state.bucket_span). The per-row state a step reads (decode_state.
DecodeState) is sized once for the cache's rows and changed only in place. Padded rows and
columns compute garbage nobody reads: a padded row is a cache row no request holds (its
length stays 0, so it attends to its own first slots), a padded column writes slots past
its row's length, which later steps overwrite. Knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssdlocal.backends.torch.decode_state import bucket_span
from ssdlocal.backends.torch.graphs import bucket


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
