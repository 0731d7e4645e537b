"""The llama.cpp runner's prefix store: earlier calls' prefixes kept as llama.cpp sequences.

llama.cpp keeps one unified KV cache whose cells carry sets of sequence ids; `seq_cp`
adds a sequence id to cells (no data moves) and `seq_rm` takes it away (a cell with no id
left is free). So keeping a row's prefix is one seq_cp into a reserved sequence, and a
later row starts from it with one seq_cp back. This module decides which reserved
sequence holds which tokens (least recently used out first, a prefix that a longer
stored one extends replaced by it, at most `tokens` cells counted per entry); the runner
makes the llama.cpp calls. Matches are token for token (no blocks); with `whole`, only an
entry all of whose tokens begin a row's matches (see stored.py for the models that need
it). Knows nothing about llama.cpp itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

STORE_SEQUENCES = 8  # reserved llama.cpp sequences: prefixes kept at once


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class SeqStore:
    """Reserved sequence ids -> the tokens their cells hold, within a budget of cells."""

    def __init__(self, ids: Sequence[int], tokens: int, whole: bool = False) -> None:
        self.ids = tuple(ids)
        self.budget = tokens
        self.whole = whole  # entries are used whole only (a prefix of them is no match)
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # oldest use first
        self.lookups = 0
        self.reused_tokens = 0
        self.stored_tokens = 0
        self.evicted_tokens = 0

    def best(self, tokens: Sequence[int], count: bool = True) -> tuple[int | None, int]:
        """(sequence, n): the stored sequence sharing the longest prefix with `tokens`.
        `count` False: a look that is no lookup of a row (not in the report's counts)."""
        self.lookups += count
        found, best = None, 0
        for seq, held in self.entries.items():
            n = common_prefix(held, tokens)
            if self.whole and n < len(held):
                continue
            if n > best:
                found, best = seq, n
        if found is not None:
            self.entries.move_to_end(found)
            self.reused_tokens += best if count else 0
        return found, best

    def place(self, tokens: Sequence[int]) -> tuple[int | None, list[int]]:
        """(sequence to copy `tokens` into or None, sequences to empty first).

        None when a stored sequence already holds `tokens` (or a longer run starting with
        them), or when they do not fit the budget at all."""
        tokens = tuple(tokens)
        for seq, held in self.entries.items():
            if (held == tokens) if self.whole else held[: len(tokens)] == tokens:
                self.entries.move_to_end(seq)
                return None, []
        if not tokens or len(tokens) > self.budget:
            return None, []
        drop = [seq for seq, held in self.entries.items() if tokens[: len(held)] == held]  # it extends them
        for seq in drop:
            del self.entries[seq]
        while self.entries and (len(self.entries) >= len(self.ids) or self._cells() + len(tokens) > self.budget):
            drop.append(self._evict_oldest())
        seq = next(s for s in self.ids if s not in self.entries)
        self.entries[seq] = tokens
        self.stored_tokens += len(tokens)
        return seq, drop

    def reading(self, tokens: Sequence[int], source: int | None, have: int) -> tuple[int | None, list[int]]:
        """Room to read `tokens` into the store, whose first `have` tokens sequence
        `source` holds (None: none): (the sequence to decode the rest into or None when
        they do not fit, sequences to empty first). An entry holding just those `have`
        tokens grows in place; else a new entry starts as a copy of `source`'s first
        `have` cells (the caller's seq_cp) and is recorded as holding them. `record` the
        tokens once they are in."""
        tokens = tuple(tokens)
        if len(tokens) > self.budget:
            return None, []
        in_place = source is not None and len(self.entries[source]) == have
        keep = () if source is None else (source,)
        added = len(tokens) - (have if in_place else 0)
        drop = []
        while (not in_place and len(self.entries) >= len(self.ids)) or self._cells() + added > self.budget:
            if len(self.entries) <= len(keep):
                return None, drop
            drop.append(self._evict_oldest(keep))
        if in_place:
            return source, drop
        seq = next(s for s in self.ids if s not in self.entries)
        self.entries[seq] = tokens[:have]
        return seq, drop

    def record(self, seq: int, tokens: Sequence[int]) -> None:
        """Sequence `seq` (from `reading`) now holds `tokens`."""
        self.stored_tokens += len(tokens) - len(self.entries[seq])
        self.entries[seq] = tuple(tokens)
        self.entries.move_to_end(seq)

    def fit(self, budget: int) -> list[int]:
        """Make `budget` cells the store's size (rows of a larger batch take the rest of the
        context, or give it back): entries out, least recently used first, until the rest
        fits. The sequences to empty."""
        self.budget = budget
        drop = []
        while self.entries and self._cells() > budget:
            drop.append(self._evict_oldest())
        return drop

    def _evict_oldest(self, keep: Sequence[int] = ()) -> int:
        """Forget the least recently used entry (but those in `keep`); its sequence (to empty)."""
        seq = next(s for s in self.entries if s not in keep)
        self.evicted_tokens += len(self.entries.pop(seq))
        return seq

    def _cells(self) -> int:
        return sum(map(len, self.entries.values()))  # shared cells counted once per entry: an upper bound

    def clear(self) -> list[int]:
        """Forget every entry; the sequences to empty."""
        seqs = list(self.entries)
        self.entries.clear()
        return seqs

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
