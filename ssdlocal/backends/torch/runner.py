"""TorchRunner: the Runner protocol (backends/base.py) over our torch Transformer.

Two ways to feed a row's tokens. `feed` takes host token lists of any length (prefill,
the SSD speculator) and remembers `held[b]`, the tokens in slots 0..len-1. `step` is
the decode path: ids already on the device, positions from the per-row `lengths` kept
on the device and moved only by `advance` (also on the device), causal masks built on
the device, and, on CUDA, one captured graph per (batch, tokens, span bucket) shape.
The KV cache starts small and doubles as rows grow (an answer bounded only by the
context does not reserve the whole context up front). Rejected drafts need no rollback:
the write position is the only cache state (as in gpt-fast). The runner knows nothing
about speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssdlocal.backends.base import sync_held
from ssdlocal.backends.torch.graphs import bucket, make_graph_cache
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.model import Transformer, causal_mask

SLOT_ROUNDING = 256  # cache capacity grows in these steps
FIRST_CAPACITY = 1024  # slots per row allocated at first; doubled as rows grow


class TorchRunner:
    """One model, its static KV cache, and which tokens (or how many) each row holds."""

    def __init__(self, loaded: LoadedModel, *, graphs: str = "auto") -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.args.vocab_size
        self.held: list[list[int]] = []
        self.num_slots = 0  # slots per row a call may use at most
        self.capacity = 0  # slots per row allocated now (grows up to num_slots)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] for `step`
        self.plain = isinstance(self.model, Transformer)  # not a tensor-parallel group
        self.graphs = make_graph_cache(self.device, graphs) if self.plain else None
        self._offsets = torch.arange(64, device=self.device)  # [64] token offsets within a step

    # ------------------------------------------------------------------ rows
    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows. A cache of another batch size is allocated anew, small (a
        tensor-parallel model allocates `num_slots` at once: its ranks cannot grow)."""
        full = not self.plain and num_slots > self.capacity
        if batch_size != len(self.held) or self.capacity == 0 or full:
            first = min(num_slots, FIRST_CAPACITY) if self.plain else num_slots
            self._allocate(batch_size, _rounded(first))
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _allocate(self, batch_size: int, capacity: int) -> None:
        self.model.setup_cache(batch_size, capacity, self.loaded.dtype, self.device)
        self.capacity = capacity
        if self.graphs is not None:
            self.graphs.clear()  # they read the old cache

    def _ensure(self, slots: int) -> None:
        """Room for slot indices below `slots`: double the capacity (up to num_slots,
        rounded) keeping the contents; needing more than num_slots is a caller bug."""
        if slots <= self.capacity:
            return
        limit = _rounded(self.num_slots)
        if slots > limit or not self.plain:
            raise RuntimeError(f"KV cache too small: slot {slots - 1}, {self.num_slots} sized")
        self.model.grow_cache(min(limit, _rounded(max(slots, 2 * self.capacity))))
        self.capacity = self.model.num_slots
        if self.graphs is not None:
            self.graphs.clear()  # they read the old cache

    def cached(self, row: int) -> int:
        return len(self.held[row])

    def pending(self, row: int, tokens: Sequence[int]) -> list[int]:
        """Tokens of `tokens` (the row's full sequence) not yet in the cache."""
        return list(tokens[len(self.held[row]) :])

    def sync(self, row: int, committed: Sequence[int]) -> None:
        """Keep only the cached tokens the next feed can build on (see `sync_held`)."""
        sync_held(self.held[row], committed)

    # ------------------------------------------------------------------ host feeds
    @torch.inference_mode()
    def feed(self, rows: Sequence[Sequence[int]]) -> list[Tensor]:
        """Append rows[b] to row b's cache; per row float32 logits [len(rows[b]), V]
        on the runner's device (empty rows give [0, V])."""
        lengths = [len(r) for r in rows]
        t_max = max(lengths)
        if t_max == 0:
            return [torch.empty(0, self.vocab_size, device=self.device) for _ in rows]
        starts = [len(h) for h in self.held]
        self._ensure(max(starts) + t_max)
        ids = torch.tensor([list(r) + [0] * (t_max - len(r)) for r in rows], dtype=torch.long)
        ids = ids.to(self.device)  # [B, T]; pads write past held, harmless
        positions = torch.tensor(starts, device=self.device)[:, None] + self._arange(t_max)  # [B, T]
        fresh = self.plain and not any(starts) and len(set(lengths)) == 1
        mask = None if fresh else causal_mask(positions, max(starts) + t_max)  # [B, T, S]
        logits = self.model(ids, positions, positions, mask)  # [B, T, V] float32
        for b, r in enumerate(rows):
            self.held[b].extend(r)
        return [logits[b, : lengths[b]] for b in range(len(rows))]

    # ------------------------------------------------------------------ device steps
    def begin_steps(self) -> None:
        """Start decoding with `step`: each row's length is what `feed` left cached."""
        self.lengths = torch.tensor([len(h) for h in self.held], device=self.device)

    @torch.inference_mode()
    def step(self, ids: Tensor, bound: int | None = None) -> Tensor:
        """ids [B, T] long on the device, written at positions lengths..lengths+T-1 of
        each row -> logits [B, T, V] float32 (a static buffer under graphs: read it
        before the next step). `bound`: a host-known bound on max(lengths) + T, which
        limits the attention span (None: every slot a call may use). `lengths` does not
        move: call `advance`. `held` is not kept up to date by steps."""
        span = _rounded(self.num_slots) if bound is None else bound
        if self.graphs is not None or self.device.type == "cuda":
            span = min(_bucket_span(span), _rounded(self.num_slots))  # few shapes to capture
        self._ensure(span)
        if self.graphs is not None:
            step = lambda ids: self._step(ids, span)  # noqa: E731 - span is part of the key
            return self.graphs.run(("step", *ids.shape, span), step, ids=ids)
        return self._step(ids, span)

    @torch.inference_mode()
    def advance(self, n: Tensor | int) -> None:
        """lengths += n ([B] long on the device, or one int for every row), in place."""
        self.lengths += n

    def _step(self, ids: Tensor, span: int) -> Tensor:
        """Attention over slots [0, span), masked causally on the device (capturable)."""
        positions = self.lengths[:, None] + self._arange(ids.shape[1])  # [B, T]
        mask = causal_mask(positions, span)  # [B, T, S]
        return self.model(ids, positions, positions, mask)  # [B, T, V]

    def _arange(self, n: int) -> Tensor:
        if n > self._offsets.numel():
            self._offsets = torch.arange(n, device=self.device)
        return self._offsets[:n]

    # ------------------------------------------------------------------ trees (SSD)
    @torch.inference_mode()
    def forward_raw(self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """Tree step with explicit positions/slots/mask ([B, T] x3, [B, T, S], on the
        device); does not touch `held`. Returns logits [B, T, V] float32 on the device,
        which the caller owns."""
        self._ensure(mask.shape[-1])
        if self.graphs is not None:
            return self.graphs.run(
                ("tree", *mask.shape), self.model, input_ids=ids, positions=positions,
                slots=slots, attn_mask=mask,
            ).clone()  # fmt: skip
        return self.model(ids, positions, slots, mask)  # [B, T, V]

    def tree_width(self, width: int) -> int:
        """Tree steps of `width` branches are padded to this many (graph buckets)."""
        return bucket(width) if self.graphs is not None else width

    @torch.inference_mode()
    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """Copy the k/v of scratch slots `src` to slots start.. and record `tokens` there."""
        if len(src) != len(tokens):
            raise ValueError(f"{len(src)} slots for {len(tokens)} tokens")  # a caller bug
        dst = torch.arange(start, start + len(src), device=self.device)  # [n]
        self.model.copy_slots(row, torch.tensor(list(src), device=self.device), dst)
        held = self.held[row]
        del held[start:]
        held.extend(tokens)


def _rounded(slots: int) -> int:
    return -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING


def _bucket_span(span: int) -> int:
    """Captured steps attend over a power-of-two number of slots (at least 256)."""
    bucket = SLOT_ROUNDING
    while bucket < span:
        bucket *= 2
    return bucket
