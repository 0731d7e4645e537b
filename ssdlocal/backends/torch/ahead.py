"""Reading a waiting request's prompt into the torch runner's prefix store, between rounds.

A serving engine reads the prompt of a request that will join its running batch ahead of
the re-seat, a chunk per round boundary, so the running rows keep streaming
(Runner.read_ahead). The rows' cache cannot take it (its rows are the batch's), so the
runner keeps a one-row cache of its own, the *staging row*: for each chunk the model's
layers are given that cache, the chunk is fed like any prompt, its whole blocks are
stored, and the batch's cache is put back. The staging row lives until the runner's next
`reset` (the re-seat that seats the request takes its tokens from the store).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ssdlocal.backends.base import Logits
from ssdlocal.backends.torch.kvcache import rounded_slots


class StagingRow:
    """The torch runner's one-row cache for reading ahead, and the tokens it holds."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.caches: list | None = None  # one KVCache per layer, [1, Hkv, slots, D]
        self.held: list[list[int]] = [[]]

    def drop(self) -> None:
        self.caches, self.held = None, [[]]

    @torch.inference_mode()
    def read(self, tokens: Sequence[int], n: int) -> int:
        """Feed the `n` tokens of `tokens` past what the staging row and the store hold;
        store the whole blocks; return how many of `tokens`' first tokens the store holds."""
        runner = self.runner
        if n > 0:
            with self._installed(len(tokens)):
                stored = len(runner.prefix.match(tokens, count=False)) * runner.prefix.block_tokens
                have = runner.holds(0, tokens)
                if stored > have:  # the store went further (another row stored it): start from there
                    runner.held[0] = []
                    runner.load_stored(0, tokens, count=False)
                else:
                    del runner.held[0][have:]  # a row's write position is its only state
                have = len(runner.held[0])
                runner.feed([list(tokens[have : have + n])], Logits.NONE)
                runner.store(0, tokens[: len(runner.held[0])])
        return len(runner.prefix.match(tokens, count=False)) * runner.prefix.block_tokens

    @contextmanager
    def _installed(self, slots: int) -> Iterator[None]:
        """The model and runner on the staging row for a while; the batch's cache after."""
        runner, model = self.runner, self.runner.model
        saved = (model.caches(), runner.held, runner.capacity, runner.num_slots)
        need = rounded_slots(slots + 1)
        try:
            if self.caches is None or self.caches[0].num_slots < need:
                self.caches = None  # the old one goes first
                self.caches = model.new_caches(1, need, runner.loaded.dtype, runner.device)
            model.use_caches(self.caches)
            runner.held, runner.capacity, runner.num_slots = self.held, need, need
            yield
        finally:
            model.use_caches(saved[0])
            runner.held, runner.capacity, runner.num_slots = saved[1:]
