"""Per-call grammar state: one matcher per constrained row, walked along each proposal.

Under a grammar the target's distribution at a position is its p masked to the tokens the
grammar allows after everything before that position, renormalised. `Guides.allowed`
gives a round that mask for every position it verifies: for a row with drafts d_1..d_n,
position i's mask is the grammar's allowed set after the committed tokens and d_1..d_i.
It walks the row's matcher along the proposal and stops at the first draft the grammar
forbids: verification rejects that draft there (its masked p is 0), so no later position is
reached and their masks are left open. `commit` rolls back what the round did not keep and
consumes the tokens the row took; the mask after them is the next round's first. A drafter
may walk the same matcher while drafting (`draft_allowed`): its masks are the ones
verification then reuses, so masking drafts costs no extra grammar work.
Rows never share a matcher; a row without a grammar gets no mask (every token allowed).
The time all this takes is charged to the constrained rows (`take_seconds`, for the stats).
Host waits (core.hostsync): one read per draft a drafter hands the matcher (it needs the
token on the host to walk); masks are built on the host and go to the device through
staged uploads (pinned, non-blocking on CUDA), so none of them waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from ssdlocal.core.hostsync import Audit


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(words: Tensor, vocab_size: int) -> Tensor:
    """int32 bitmask words [..., W] (bit j of word i = token 32i + j) -> bool [..., V]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)  # [32]
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()  # [..., V]


class RowGuide:
    """One row's matcher, and the tokens walked past the row's committed ones this round.

    masks[i] is the allowed-token bitmask (int32 words [W], on the host) after the
    committed tokens and walked[:i]; there is always one more mask than walked tokens.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher  # llguidance.LLMatcher, this row's own
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.walked: list[int] = []
        self._after_end = 0  # walked tokens past the grammar's end (EOS only; the matcher ignores them)
        self.masks: list[Tensor] = [self._fill()]

    def _fill(self) -> Tensor:
        words = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)  # [W]
        if self.matcher.is_stopped():  # the grammar has ended (an answer going on past its EOS)
            words.zero_()
            for t in self.eos_ids:
                word = int(words[t >> 5]) | (1 << (t & 31))
                words[t >> 5] = word - (1 << 32) if word >= 1 << 31 else word
            return words
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar engine failed: {self.matcher.get_error()[:300]}")
        return words

    @staticmethod
    def allows(words: Tensor, token: int) -> bool:
        """Whether the host bitmask `words` [W] allows `token` (read through numpy: host memory)."""
        return 0 <= token and (int(words.numpy()[token >> 5]) >> (token & 31)) & 1 == 1

    def walk(self, tokens: Sequence[int]) -> int:
        """Walk from the committed state along `tokens` (reusing the walk so far where it
        agrees); stops before the first forbidden token. Returns how many were walked."""
        common = 0
        while common < min(len(self.walked), len(tokens)) and self.walked[common] == tokens[common]:
            common += 1
        if common < len(self.walked):
            drop = len(self.walked) - common
            after_end = min(drop, self._after_end)
            self._after_end -= after_end
            if drop > after_end:
                self.matcher.rollback(drop - after_end)
            del self.walked[common:]
            del self.masks[common + 1 :]
        for token in tokens[common:]:
            if not self.allows(self.masks[-1], token):
                break
            if self.matcher.is_stopped():
                self._after_end += 1
            elif not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar engine refused an allowed token: {self.matcher.get_error()[:300]}")
            self.walked.append(token)
            self.masks.append(self._fill())
        return len(self.walked)

    def commit(self, taken: Sequence[int]) -> None:
        """The row took `taken` this round: they become committed; the next round starts
        from the mask after them."""
        if self.walk(taken) < len(taken):  # the target emits only allowed tokens
            raise RuntimeError("a committed token is not allowed by the row's grammar")
        self.walked = []
        self._after_end = 0
        self.masks = [self.masks[-1]]



class Guides:
    """The grammar state of one generate call: a RowGuide per row that has a grammar.

    `grammars[b]`: a grammar.compiler.Grammar for row b, or None (unconstrained).
    """

    def __init__(self, grammars: Sequence, vocab_size: int, eos_ids: Sequence[int], audit: Audit | None = None) -> None:
        self.vocab_size = vocab_size
        audit = audit or Audit()
        self.target_site = audit.site("target")  # verification's masks go up to the target
        self.draft_site = audit.site("draft")  # drafting's masks go up to the draft
        self.constrained = tuple(g is not None for g in grammars)
        self._spent = [0.0] * len(grammars)  # seconds per row not yet reported (take_seconds)
        self._depth = 0
        with self.timing([True] * len(grammars)):
            self.rows = [None if g is None else RowGuide(g.matcher(), vocab_size, eos_ids) for g in grammars]
        self._drafted: list[list[int]] = [[] for _ in self.rows]

    @contextmanager
    def timing(self, active: Sequence[bool]):
        """Charge the time spent inside to the active constrained rows, split evenly: the
        grammar's walks and masks and the tensor work that applies them (callers wrap that).
        Nested uses are charged once, by the outermost."""
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            rows = [b for b, on in enumerate(active) if on and self.constrained[b]]
            for b in rows if self._depth == 0 else ():
                self._spent[b] += (time.perf_counter() - t0) / len(rows)

    def allowed(self, drafts: Sequence[Sequence[int]], width: int, active: Sequence[bool], device) -> Tensor:
        """bool [B, width+1, V] on `device`: position i of row b allows what the grammar
        allows after row b's committed tokens and drafts[b][:i] (open past the first
        forbidden draft, past the row's drafts, and for rows without a grammar)."""
        with self.timing(active):
            words = torch.full((len(self.rows), width + 1, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
            for b, guide in enumerate(self.rows):
                if guide is None or not active[b]:
                    continue
                n = guide.walk(list(drafts[b])[:width])
                words[b, : n + 1] = torch.stack(guide.masks[: n + 1])
            return unpack(self.target_site.to_device(words, device), self.vocab_size)  # [B, width+1, V]

    def draft_allowed(self, j: int, previous: Tensor | None, active: Sequence[bool], device) -> Tensor:
        """For a drafter that masks its own drafts: bool [B, V], what the grammar allows at
        draft position j (after d_1..d_j-1; `previous` [B] is d_j-1, None at j = 0)."""
        with self.timing(active):
            if j == 0:
                self._drafted = [[] for _ in self.rows]
            elif previous is not None:
                for b, token in enumerate(self.draft_site.read(previous)):  # the walk needs it on the host
                    self._drafted[b].append(token)
            words = torch.full((len(self.rows), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
            for b, guide in enumerate(self.rows):
                if guide is None or not active[b]:
                    continue
                n = guide.walk(self._drafted[b])
                words[b] = guide.masks[n]  # n < j only if a draft was forbidden: later drafts are moot
            return unpack(self.draft_site.to_device(words, device), self.vocab_size)  # [B, V]

    def drafted_tokens(self, last: Tensor, active: Sequence[bool], site=None) -> list[list[int]]:
        """After a drafter's K `draft_allowed` steps: every row's drafts d_1..d_K as host
        lists ([] for idle rows), reading only d_K (`last` [B], through `site`, default the
        draft's) — the others were read for the walk. Verification reuses them."""
        site = site or self.draft_site
        final = site.read(last)
        return [self._drafted[b] + [final[b]] if active[b] else [] for b in range(len(self.rows))]

    def commit(self, taken: Sequence[Sequence[int]], active: Sequence[bool]) -> None:
        """Each active constrained row took `taken[b]` (accepted drafts, then the bonus)."""
        with self.timing(active):
            for b, guide in enumerate(self.rows):
                if guide is not None and active[b] and taken[b]:
                    guide.commit(taken[b])

    def take_seconds(self) -> list[float]:
        """Seconds charged to each row since the last call (0 for rows without a grammar)."""
        spent, self._spent = self._spent, [0.0] * len(self._spent)
        return spent
