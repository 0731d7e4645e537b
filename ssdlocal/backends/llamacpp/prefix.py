"""The llama.cpp runner's prefix store: earlier calls' rows kept as llama.cpp sequence states.

When a call ends, a row's cells (keys, values, positions) are saved with llama.cpp's
sequence state (`seq_state`, one copy into RAM); a later row that shares a prefix restores
the state into its empty sequence (`set_seq_state`) and cuts it to that prefix. Kept out of
the context, stored prefixes take no cells there: a row alone in its call finds the
context empty, so its cells are cells 0, 1, 2, ... for positions 0, 1, 2, ... whether it
was read cold or restored, which is what llama.cpp's CPU kernels need to give a token the
same logits (they sum attention over cells in cell order, vectorised: docs/architecture.md
§2). Each entry also counts how many of its leading tokens a cold read reproduces bit for
bit (`exact`: whole canonical prompt chunks of a row read alone); a lone row reuses only
those. This module decides which entry holds which tokens (least recently used out first,
an entry that a longer one extends replaced by it, at most `tokens` cells in all); the
runner makes the llama.cpp calls. Matches are token for token. Knows nothing about
llama.cpp itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

STORE_ENTRIES = 8  # prefixes kept at once


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


@dataclass(frozen=True)
class Entry:
    """One stored row: its tokens, llama.cpp's saved state of its sequence (`cells` cells,
    at least the tokens), and how many leading tokens a cold read reproduces bit for bit."""

    tokens: tuple[int, ...]
    state: bytes
    cells: int
    exact: int


class StateStore:
    """Stored rows, least recently used first, within a budget of cells."""

    def __init__(self, tokens: int, entries: int = STORE_ENTRIES) -> None:
        self.budget = tokens
        self.max_entries = entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # key: a running number, oldest use first
        self._next = 0
        self.lookups = 0
        self.reused_tokens = 0
        self.stored_tokens = 0
        self.evicted_tokens = 0

    def best(self, tokens: Sequence[int], count: bool = True, exact: bool = False) -> tuple[Entry | None, int]:
        """(entry, n): the entry sharing the longest prefix with `tokens` (`exact`: only its
        exact tokens count). `count` False: a look that is no lookup of a row (not in the
        report's counts; the entry's last use does not change)."""
        self.lookups += count
        found, best = None, 0
        for key, entry in self.entries.items():
            n = common_prefix(entry.tokens, tokens)
            n = min(n, entry.exact) if exact else n
            if n > best:
                found, best = key, n
        if found is None:
            return None, 0
        if count:
            self.entries.move_to_end(found)
        return self.entries[found], best

    def counted(self, n: int) -> None:
        """A row took `n` tokens from the store (the report's reused tokens)."""
        self.reused_tokens += n

    def wanted(self, tokens: Sequence[int], exact: int) -> bool:
        """Whether keeping `tokens` (`exact` of them reproducible) adds anything: no entry
        holds them (or a longer run starting with them) at least as exactly, and they fit."""
        if not tokens or len(tokens) > self.budget:
            return False
        tokens = tuple(tokens)
        for key, entry in self.entries.items():
            if entry.tokens[: len(tokens)] == tokens and entry.exact >= exact:
                self.entries.move_to_end(key)
                return False
        return True

    def put(self, tokens: Sequence[int], state: bytes, cells: int, exact: int) -> None:
        """Keep `tokens` (`wanted` said so): entries they extend (or hold less exactly) go,
        then the least recently used until the rest fits."""
        tokens = tuple(tokens)
        for key in [k for k, e in self.entries.items() if tokens[: len(e.tokens)] == e.tokens]:
            del self.entries[key]
        while self.entries and (len(self.entries) >= self.max_entries or self._cells() + cells > self.budget):
            self._evict_oldest()
        if cells > self.budget:
            return
        self.entries[self._next] = Entry(tokens, state, cells, exact)
        self._next += 1
        self.stored_tokens += len(tokens)

    def fit(self, budget: int) -> None:
        """Make `budget` cells the store's size: entries out, least recently used first."""
        self.budget = budget
        while self.entries and self._cells() > budget:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.evicted_tokens += len(entry.tokens)

    def _cells(self) -> int:
        return sum(e.cells for e in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()

    def report(self) -> dict[str, int]:
        return {
            "capacity_tokens": self.budget,
            "used_tokens": self._cells(),
            "block_tokens": 1,
            "lookups": self.lookups,
            "reused_tokens": self.reused_tokens,
            "stored_tokens": self.stored_tokens,
            "evicted_tokens": self.evicted_tokens,
        }
