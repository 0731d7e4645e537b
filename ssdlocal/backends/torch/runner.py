"""TorchRunner: the Runner protocol (backends/base.py) over our torch Transformer.

Two ways to feed a row's tokens. `feed` takes host token lists of any length (prefill,
the SSD speculator) and remembers `held[b]`, the tokens in slots 0..len-1. `step` is
the decode path: ids already on the device, positions from the per-row `lengths` kept
on the device and moved only by `advance` (also on the device), causal masks built on
the device, and, on CUDA, one captured graph per (batch, tokens) shape. Rejected drafts
need no rollback: the write position is the only cache state (as in gpt-fast). The
runner knows nothing about speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ssdlocal.backends.base import sync_held
from ssdlocal.backends.torch.graphs import bucket, make_graph_cache
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.model import Transformer, causal_mask

SLOT_ROUNDING = 256  # cache capacity grows in these steps, so captured graphs stay valid


class TorchRunner:
    """One model, its static KV cache, and which tokens (or how many) each row holds."""

    def __init__(self, loaded: LoadedModel, *, graphs: str = "auto") -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.args.vocab_size
        self.held: list[list[int]] = []
        self.num_slots = 0  # slots per row the caller asked for
        self.capacity = 0  # slots per row allocated (>= num_slots)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] for `step`
        self.plain = isinstance(self.model, Transformer)  # not a tensor-parallel group
        self.graphs = make_graph_cache(self.device, graphs) if self.plain else None
        self._offsets = torch.arange(64, device=self.device)  # [64] token offsets within a step

    # ------------------------------------------------------------------ rows
    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows; (re)allocate the cache when the shape outgrows it."""
        if batch_size != len(self.held) or num_slots > self.capacity:
            capacity = -(-num_slots // SLOT_ROUNDING) * SLOT_ROUNDING
            self.model.setup_cache(batch_size, capacity, self.loaded.dtype, self.device)
            self.capacity = capacity
            if self.graphs is not None:
                self.graphs.clear()  # they read the old cache
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)

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
        if max(s + t_max for s in starts) > self.capacity:
            raise RuntimeError("KV cache too small for this step")  # engine sizes it; a bug if hit
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
    def step(self, ids: Tensor) -> Tensor:
        """ids [B, T] long on the device, written at positions lengths..lengths+T-1 of
        each row -> logits [B, T, V] float32 (a static buffer under graphs: read it
        before the next step). `lengths` does not move: call `advance`. `held` is not
        kept up to date by steps (reset before feeding again)."""
        if self.graphs is not None:
            return self.graphs.run(("step", *ids.shape), self._step_full, ids=ids)
        if self.device.type == "cuda":
            return self._step_full(ids)  # no host sync for a span
        return self._step_span(ids)

    @torch.inference_mode()
    def advance(self, n: Tensor | int) -> None:
        """lengths += n ([B] long on the device, or one int for every row), in place."""
        self.lengths += n

    def _step_full(self, ids: Tensor) -> Tensor:
        """The capturable step: attention over every allocated slot, masked causally."""
        positions = self.lengths[:, None] + self._arange(ids.shape[1])  # [B, T]
        mask = causal_mask(positions, self.capacity)  # [B, T, S] built on the device
        return self.model(ids, positions, positions, mask)  # [B, T, V]

    def _step_span(self, ids: Tensor) -> Tensor:
        """The CPU step: attention over the slots in use only."""
        positions = self.lengths[:, None] + self._arange(ids.shape[1])  # [B, T]
        mask = causal_mask(positions, int(positions.max()) + 1)  # [B, T, S]
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
