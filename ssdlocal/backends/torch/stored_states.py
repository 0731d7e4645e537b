"""The prefix store of a hybrid model: KV blocks as for every model (stored.py), and the
linear-attention state at a block end.

A stored prefix is only worth taking back if the row's linear layers can continue from its
end, and a state is as large as many tokens' keys and values, so states are not kept per
block but for a few block ends: at `store`, the states after the stored sequence's whole
blocks that the row's block-end entries still hold (linear_states.py: its last block end,
and the newest before it that no later write replaced), in a pool of STATE_SLOTS (least
recently used goes first). `reuse` takes the longest stored prefix
that ends at a block whose state is kept (not mid-block, not past the last state), loads
its KV blocks as every runner does and puts the state in the row's ring: the row then
continues exactly as a cold read of the same tokens would. A pool slot remembers which
block it belongs to (the index's `key`: parent and tokens), so a block evicted and reused
for other tokens never hands out a stale state. A mixin of HybridRunner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from ssdlocal.backends.prefix import BLOCK_TOKENS
from ssdlocal.backends.torch.kvcache import runs_of
from ssdlocal.backends.torch.linear_states import Shapes

STATE_SLOTS = 16  # block-end states a hybrid model's prefix store keeps


class StatePool:
    """`slots` block-end states of every linear layer of `shapes`: windows [slots, K-1, C]
    and recurrent states [slots, H, Dk, Dv] per layer, with which block each belongs to."""

    def __init__(self, slots: int, shapes: Shapes, kernel: int, dtype, device) -> None:
        self.rec = [torch.empty(slots, h, dk, dv, device=device) for _, h, dk, dv in shapes]
        self.conv = [torch.empty(slots, kernel - 1, c, dtype=dtype, device=device) for c, *_ in shapes]
        self.owners: OrderedDict[int, tuple[int, object]] = OrderedDict()  # slot -> (block, its key), oldest first
        self.slots = slots

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.rec, *self.conv))

    def find(self, block: int, key) -> int | None:
        """The slot holding block `block`'s state while the block is still `key`."""
        for slot, owner in self.owners.items():
            if owner == (block, key):
                self.owners.move_to_end(slot)
                return slot
        return None

    def put(self, block: int, key, windows: list[Tensor], states: list[Tensor]) -> None:
        """Keep block `block`'s (`key`) state: per layer its window and recurrent state."""
        slot = self.find(block, key)
        if slot is None:
            taken = set(self.owners)
            slot = next((s for s in range(self.slots) if s not in taken), None)
            if slot is None:
                slot, _ = self.owners.popitem(last=False)  # the least recently used
        for layer, (window, state) in enumerate(zip(windows, states)):
            self.conv[layer][slot].copy_(window)
            self.rec[layer][slot].copy_(state)
        self.owners[slot] = (block, key)
        self.owners.move_to_end(slot)

    def get(self, slot: int) -> tuple[list[Tensor], list[Tensor]]:
        return [c[slot] for c in self.conv], [r[slot] for r in self.rec]


class StoredStates:
    """HybridRunner's prefix store: setup_prefix, load_stored (reuse, read_ahead) and store."""

    states_pool: StatePool | None = None

    def setup_prefix(self, asked: int | None) -> int:
        """StoredPrefixes.setup_prefix, plus STATE_SLOTS block-end states (a tensor-parallel
        hybrid keeps no store)."""
        tokens = super().setup_prefix(asked if self.plain else 0)  # type: ignore[misc]
        model = self.model
        self.states_pool = None
        if tokens:
            self.states_pool = StatePool(
                STATE_SLOTS, model.linear_shapes(), model.kernel, self.loaded.dtype, self.device
            )
        return tokens

    def prefix_report(self) -> dict | None:
        report = super().prefix_report()  # type: ignore[misc]
        if report is not None and self.states_pool is not None:
            report = {**report, "state_slots": self.states_pool.slots, "state_bytes": self.states_pool.nbytes}
        return report

    def load_stored(self, row: int, tokens: Sequence[int], count: bool = True) -> int:
        """The longest stored prefix of `tokens` ending at a block whose state is kept: its
        KV blocks and that state into row `row` (empty); returns its tokens."""
        numbers = self.prefix.match(tokens, count=False)
        pool = self.states_pool
        found = None
        while numbers and pool is not None:
            found = pool.find(numbers[-1], self.prefix.key(numbers[-1]))
            if found is not None:
                break
            numbers.pop()
        n = len(numbers) * BLOCK_TOKENS
        if count:
            self.prefix.lookups += 1
            self.prefix.hit_tokens += n
        if n and found is not None and pool is not None:
            self._ensure(n)
            self.model.load_prefix(row, runs_of(list(enumerate(numbers)), BLOCK_TOKENS))
            self.states.truncated(row, 0)
            self.states.place(row, n - 1, *pool.get(found))
            self.held[row] = list(tokens[:n])
        return n

    @torch.inference_mode()
    def store(self, row: int, tokens: Sequence[int]) -> None:
        """StoredPrefixes.store, and the state after each whole block of `tokens` that the
        row's block entries are known to hold (the last one, and the newest before it that
        no later write replaced: e.g. a prompt's last block end when the answer is short)."""
        if self.prefix is None or self.states_pool is None:
            return
        super().store(row, tokens)  # type: ignore[misc]
        numbers = self.prefix.match(tokens[: len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS], count=False)
        for m, number in enumerate(numbers):  # the blocks stored (not all when the pool was full)
            end = (m + 1) * BLOCK_TOKENS - 1
            if self._holds_block(row, end, last=end + BLOCK_TOKENS > len(tokens)):
                self.states_pool.put(number, self.prefix.key(number), *self.states.block_state(row, end))

    def _holds_block(self, row: int, end: int, last: bool) -> bool:
        """Whether row `row`'s block entries hold its state after block end `end` (a
        position it holds; `last`: its last whole block). Known from feeds and `end_steps`
        (LinearStates.block_host). During steps the host map is behind: steps wrote every
        block end from `begin_steps` on, rejected ones too, and a step's write at end E'
        replaces entry E'/16 mod Cb. The last block end is held (the entries keep the
        newest ones past any row's length); an earlier one known to the host still is
        unless a step may have written a block end Cb blocks or more past it (Cb as at
        `begin_steps`: entries only grow)."""
        if self.counts is None or row >= len(self.begun):
            return self.states.knows_block(row, end)
        if last and end >= self.begun[row]:
            return True
        written = self.begun[row] + self.stepped - 1  # the furthest position a step may have written
        return self.states.knows_block(row, end) and written < end + BLOCK_TOKENS * self.begun_ends
