"""The prefix store of a hybrid model: KV blocks as for every model (stored.py), and the
linear-attention state at a block end.

A stored prefix is only worth taking back if the row's linear layers can continue from its
end, and a state is as large as many tokens' keys and values, so states are not kept per
block but for a few block ends: at `store`, the state after the stored sequence's last
whole block (from the block-end entries of the row's states: linear_states.py), in a pool
of STATE_SLOTS (least recently used goes first). `reuse` takes the longest stored prefix
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
        """StoredPrefixes.store, and the state after the last whole block of `tokens` when
        the row's states are known to hold it."""
        if self.prefix is None or self.states_pool is None:
            return
        super().store(row, tokens)  # type: ignore[misc]
        n = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
        if not n or not self._holds_block(row, n - 1):
            return
        numbers = self.prefix.match(tokens[:n], count=False)
        if len(numbers) * BLOCK_TOKENS == n:  # the last block is stored (not when the pool was full)
            self.states_pool.put(numbers[-1], self.prefix.key(numbers[-1]), *self.states.block_state(row, n - 1))

    def _holds_block(self, row: int, end: int) -> bool:
        """Whether row `row`'s block entries hold its state after block end `end` (a
        position it holds): known from feeds and `end_steps`, and during steps for every
        block end the steps wrote (positions from `begin_steps` on: each step writes the
        block ends it feeds, and the entries keep the newest ones past any row's length)."""
        if self.states.knows_block(row, end):
            return True
        return self.counts is not None and row < len(self.begun) and end >= self.begun[row]
