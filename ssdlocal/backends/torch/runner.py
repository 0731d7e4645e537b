"""TorchRunner: the Runner protocol (backends/base.py) over our torch Transformer.

The runner knows nothing about speculation. It feeds tokens, returns logits, and
keeps `held[b]`, the tokens of row b whose keys/values sit in cache slots
0..len(held[b])-1. Rejected drafts need no rollback of the cache itself: `sync`
only shortens `held` (the write position is the only cache state, as in gpt-fast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.backends.base import sync_held
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.model import causal_mask


class TorchRunner:
    """Feeds variable-length token lists per row through one model with a static cache."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.args.vocab_size
        self.held: list[list[int]] = []
        self.num_slots = 0
        self.pad_id = 0

    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows; (re)allocate the cache when the shape changes."""
        if batch_size != len(self.held) or num_slots > self.num_slots:
            self.model.setup_cache(batch_size, num_slots, self.loaded.dtype, self.device)
            self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]

    def cached(self, row: int) -> int:
        return len(self.held[row])

    def pending(self, row: int, tokens: Sequence[int]) -> list[int]:
        """Tokens of `tokens` (the row's full sequence) not yet in the cache."""
        return list(tokens[len(self.held[row]) :])

    @torch.inference_mode()
    def feed(self, rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Append rows[b] to row b's cache and return their logits.

        rows: one token list per cache row (empty = row idle this step).
        Returns per row a float32 tensor [len(rows[b]), V] (empty rows give [0, V]).
        """
        lengths = [len(r) for r in rows]
        t_max = max(lengths)
        if t_max == 0:
            return [torch.empty(0, self.vocab_size) for _ in rows]
        batch = len(rows)
        starts = [len(h) for h in self.held]
        if max(s + t_max for s in starts) > self.num_slots:
            raise RuntimeError("KV cache too small for this step")  # engine sizes it; a bug if hit
        ids = torch.full((batch, t_max), self.pad_id, dtype=torch.long)  # [B, T]
        for b, r in enumerate(rows):
            if r:
                ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        offsets = torch.arange(t_max).unsqueeze(0)  # [1, T]
        positions = torch.tensor(starts).unsqueeze(1) + offsets  # [B, T]; pads write past held, harmless
        span = max(starts) + t_max
        mask = causal_mask(positions, span)  # [B, T, S]
        logits = self.model(
            ids.to(self.device), positions.to(self.device), positions.to(self.device), mask.to(self.device)
        )  # [B, T, V] float32
        logits = logits.float().cpu()
        for b, r in enumerate(rows):
            self.held[b].extend(r)
        return [logits[b, : lengths[b]] for b in range(batch)]

    def sync(self, row: int, committed: Sequence[int]) -> None:
        """Keep only the cached tokens the next feed can build on (see `sync_held`)."""
        sync_held(self.held[row], committed)

    # ---- tree decoding support (SSD pre-speculation) ----
    @torch.inference_mode()
    def forward_raw(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Forward with explicit positions/slots/mask; does not touch `held`.

        ids, positions, slots [B, T] long; mask [B, T, S] bool. Returns logits [B, T, V] float32 (CPU).
        """
        dev = self.device
        logits = self.model(ids.to(dev), positions.to(dev), slots.to(dev), mask.to(dev))  # [B, T, V]
        return logits.float().cpu()

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
