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
those. A state is cut only where it still holds what the row needs there (`cuts_to`): a
recurrent model's (`whole`) not at all, its state being at its end; a sliding-window
model's (`window`) only where the window before the cut is all there (`Entry.first`).
This module decides which entry holds which tokens (least recently used out first, an
entry made useless by a longer one replaced by it, at most `tokens` cells in all); the
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
    at least the tokens), how many leading tokens a cold read reproduces bit for bit, and
    the first position the state holds cells for (above 0 where a sliding window let
    llama.cpp reuse the cells before it)."""

    tokens: tuple[int, ...]
    state: bytes
    cells: int
    exact: int
    first: int = 0


class StateStore:
    """Stored rows, least recently used first, within a budget of cells. `whole`: states
    are never cut (a recurrent model's); `window`: the sliding window in tokens (0: none)."""

    def __init__(self, tokens: int, entries: int = STORE_ENTRIES, whole: bool = False, window: int = 0) -> None:
        self.budget = tokens
        self.max_entries = entries
        self.whole = whole
        self.window = window
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # key: a running number, oldest use first
        self._next = 0
        self.lookups = 0
        self.reused_tokens = 0
        self.stored_tokens = 0
        self.evicted_tokens = 0

    def cuts_to(self, first: int, n: int) -> bool:
        """Whether a state whose cells start at position `first` still serves a row that
        goes on after its first `n` tokens: a token at position n sees the window before it
        (never more than the `window` positions n - window + 1 .. n - 1)."""
        return not self.whole and first <= max(0, n - self.window + 1)

    def best(
        self, tokens: Sequence[int], count: bool = True, exact: bool = False, chunk: int = 1
    ) -> tuple[Entry | None, int]:
        """(entry, n): the entry sharing the longest prefix with `tokens` (`exact`: only its
        exact tokens count; `chunk`: n rounded down to whole chunks of that many tokens), of
        those whose state serves there (all of it, or `cuts_to` n). `count` False: a look
        that is no lookup of a row (not in the report's counts; the entry's last use does
        not change)."""
        self.lookups += count
        found, best = None, 0
        for key, entry in self.entries.items():
            n = common_prefix(entry.tokens, tokens)
            n = (min(n, entry.exact) if exact else n) // chunk * chunk
            if not self._serves(entry, n):
                continue
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
        holds them (or a longer run starting with them, whose state serves there) at least
        as exactly, and they fit."""
        if not tokens or len(tokens) > self.budget:
            return False
        tokens = tuple(tokens)
        for key, entry in self.entries.items():
            if entry.tokens[: len(tokens)] == tokens and entry.exact >= exact and self._serves(entry, len(tokens)):
                self.entries.move_to_end(key)
                return False
        return True

    def put(self, tokens: Sequence[int], state: bytes, cells: int, exact: int, first: int = 0) -> None:
        """Keep `tokens` (`wanted` said so): entries they extend and can serve in their
        place go, then the least recently used until the rest fits."""
        new = Entry(tuple(tokens), state, cells, exact, first)
        for key in [k for k, e in self.entries.items() if self._replaces(new, e)]:
            del self.entries[key]
        while self.entries and (len(self.entries) >= self.max_entries or self._cells() + cells > self.budget):
            self._evict_oldest()
        if cells > self.budget:
            return
        self.entries[self._next] = new
        self._next += 1
        self.stored_tokens += len(new.tokens)

    def _serves(self, entry: Entry, n: int) -> bool:
        """Whether `entry`'s state serves a row going on after its first `n` tokens."""
        return n >= entry.cells or self.cuts_to(entry.first, n)

    def _replaces(self, new: Entry, old: Entry) -> bool:
        """Whether `new` makes `old` useless: it extends it and serves where it ends (a
        recurrent model's longer entry does not: a shorter one serves prompts that part
        from the longer)."""
        n = len(old.tokens)
        return new.tokens[:n] == old.tokens and self._serves(new, n)

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
