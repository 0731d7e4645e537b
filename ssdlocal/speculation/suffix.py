"""Suffix-match drafting: continue the current tokens the way earlier text continued them.

`SuffixIndex` indexes token sequences by their n-grams (every position, keyed by the
`KEY` tokens before it). To propose for a context it finds every earlier place whose
tokens before it agree with the context's end (the longer the agreement, the better),
follows what came next there, and walks the continuation tree greedily: at each step the
most frequent next token, with its share of the branches as its confidence. The walk
stops where the cumulative confidence falls under `min_confidence`, so a proposal is long
where the history is unanimous and short where it is thin (SuffixDecoding's idea, on an
n-gram index rather than a suffix tree).

`SuffixMemory` is a bounded store of earlier sequences (prompts and answers) shared by the
rows of an engine: oldest first out, by count and by tokens. Pure: no torch, no files
(persistence lives with the caller). Proposals are deterministic: verified as point masses.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEY = 2  # tokens that key a position (shorter contexts match nothing)
MAX_MATCH = 32  # tokens compared backwards when ranking matches
MAX_SITES = 64  # most recent occurrences kept per key (per sequence)
BEST_SITES = 16  # continuations that vote, the best-matching first


@dataclass(frozen=True)
class SuffixProposal:
    """Draft tokens and the confidence of each (the share of matching history that
    continued that way, multiplied along the proposal: non-increasing)."""

    tokens: tuple[int, ...]
    confidence: tuple[float, ...]
    match_len: int = 0  # tokens of context the best match agreed on

    @property
    def expected(self) -> float:
        """Expected accepted tokens if the confidences are probabilities."""
        return float(sum(self.confidence))


EMPTY = SuffixProposal((), ())


class SuffixIndex:
    """One growing token sequence, indexed for `matches` (append-only)."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._sites: dict[tuple[int, ...], list[int]] = defaultdict(list)  # key -> positions after it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(int(t))
            n = len(seq)
            if n > KEY:  # the position n-1 follows the KEY tokens before it
                sites = self._sites[tuple(seq[n - 1 - KEY : n - 1])]
                sites.append(n - 1)
                if len(sites) > 2 * MAX_SITES:
                    del sites[:-MAX_SITES]

    def matches(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(match length, position) of the places whose preceding tokens equal the end of
        `context` (at least KEY of them): seq[position:] is what followed. When the index
        holds `context` itself, its own end is no such place (nothing follows it yet)."""
        if len(context) < KEY:
            return []
        found = []
        seq = self.tokens
        for pos in self._sites.get(tuple(context[-KEY:]), ()):
            n = KEY
            while n < MAX_MATCH and n < pos and n < len(context) and seq[pos - 1 - n] == context[-1 - n]:
                n += 1
            found.append((n, pos))
        return found


class SuffixMemory:
    """Earlier sequences (prompts + answers), bounded by count and by tokens."""

    def __init__(self, max_sequences: int = 256, max_tokens: int = 200_000) -> None:
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self._seqs: OrderedDict[int, SuffixIndex] = OrderedDict()
        self._next = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a finished sequence; the oldest ones go when a bound is passed."""
        if len(tokens) <= KEY or self.max_tokens <= KEY:
            return
        tokens = list(tokens[-self.max_tokens :])
        self._seqs[self._next] = SuffixIndex(tokens)
        self._next += 1
        self.tokens += len(tokens)
        while self._seqs and (len(self._seqs) > self.max_sequences or self.tokens > self.max_tokens):
            _, old = self._seqs.popitem(last=False)
            self.tokens -= len(old)

    def sequences(self) -> list[list[int]]:
        """The remembered sequences, oldest first (for persistence)."""
        return [index.tokens for index in self._seqs.values()]

    def indexes(self) -> list[SuffixIndex]:
        return list(self._seqs.values())


def propose(
    context: Sequence[int], own: SuffixIndex | None, memory: Iterable[SuffixIndex], k: int, min_confidence: float = 0.3
) -> SuffixProposal:
    """Up to `k` tokens continuing `context`, from the row's own index (`own`, which holds
    `context` itself) and the memory's indexes. EMPTY when nothing matches. Only the last
    MAX_MATCH tokens of `context` are read: a longer context gives the same proposal."""
    if k <= 0:
        return EMPTY
    sites: list[tuple[int, int, SuffixIndex]] = []
    if own is not None:
        sites += [(n, pos, own) for n, pos in own.matches(context)]
    for index in memory:
        sites += [(n, pos, index) for n, pos in index.matches(context)]
    if not sites:
        return EMPTY
    sites.sort(key=lambda s: (s[0], s[1]), reverse=True)  # longest agreement, then most recent
    best = sites[0][0]
    voters = [s for s in sites if s[0] >= max(KEY, best - 2)][:BEST_SITES]
    return _walk([index.tokens[pos : pos + k] for _, pos, index in voters], k, min_confidence, best)


def _walk(continuations: list[list[int]], k: int, min_confidence: float, match_len: int) -> SuffixProposal:
    """Greedy path through the continuations' tree: the most frequent next token while the
    cumulative share stays >= min_confidence."""
    tokens: list[int] = []
    confidence: list[float] = []
    alive = [c for c in continuations if c]
    share = 1.0
    for depth in range(k):
        counts: dict[int, int] = defaultdict(int)
        for c in alive:
            if len(c) > depth:
                counts[c[depth]] += 1
        if not counts:
            break
        token, votes = max(counts.items(), key=lambda kv: kv[1])
        share *= votes / sum(counts.values())
        if share < min_confidence:
            break
        tokens.append(token)
        confidence.append(share)
        alive = [c for c in alive if len(c) > depth and c[depth] == token]
    return SuffixProposal(tuple(tokens), tuple(confidence), match_len)
