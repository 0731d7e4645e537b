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

    The grammar engine may fail on a prefix its masks allowed (a lexer over its own
    limits, say). Then the masks from that prefix on allow only end-of-sequence, and once
    the row commits that prefix `error` holds the engine's message: the row's answer
    cannot go on under its grammar (the engine ends it with an error). A failure on
    drafts the round then rejects is undone: the matcher is rebuilt with `fresh` (a new
    matcher in the start state) and the committed tokens. The engine's lexer state is
    shared by every matcher of one compiled grammar and bounded, so where such a grammar
    fails can depend on what was drafted (a failing row's tokens may differ between
    modes; rows that do not fail stay exact). Other rows never see it.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int], fresh=None) -> None:
        self.matcher = matcher  # llguidance.LLMatcher, this row's own
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.fresh = fresh  # () -> a new matcher in the start state (None: a failure cannot be undone)
        self.error: str | None = None  # the committed tokens broke the grammar engine (its message)
        self.history: list[int] = []  # committed tokens the matcher consumed (replayed by a rebuild)
        self.walked: list[int] = []
        self._consumed: list[bool] = []  # per walked token: the matcher consumed it (not past the end or a failure)
        self._broken: int | None = None  # masks[i] for i >= this allow only EOS: the engine failed there
        self._broken_error = ""
        self.masks: list[Tensor] = [self._fill()]

    def _eos_only(self) -> Tensor:
        words = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)  # [W]
        for t in self.eos_ids:
            word = int(words[t >> 5]) | (1 << (t & 31))
            words[t >> 5] = word - (1 << 32) if word >= 1 << 31 else word
        return words

    def _fill(self) -> Tensor:
        # the grammar has ended (an answer going on past its EOS), or the engine failed
        if self._broken is not None or self.matcher.is_stopped():
            return self._eos_only()
        words = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)  # [W]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self.matcher.is_error():
            self._break(len(self.walked), self.matcher.get_error())
            return self._eos_only()
        return words

    def _break(self, at: int, message: str) -> None:
        self._broken = at
        self._broken_error = f"the grammar engine cannot continue this answer: {' '.join(message.split())[:300]}"

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
            if self._broken is not None and common < self._broken <= len(self.walked):
                self._rebuild()  # the failure is rolled back: the matcher cannot be, so start it over
                common = 0
            else:
                drop = sum(self._consumed[common:])
                if drop:
                    self.matcher.rollback(drop)
                del self.walked[common:]
                del self._consumed[common:]
                del self.masks[common + 1 :]
        for token in tokens[common:]:
            if not self.allows(self.masks[-1], token):
                break
            consumed = self._broken is None and not self.matcher.is_stopped()
            if consumed and not self.matcher.consume_token(token):
                consumed = False
                self._break(len(self.walked) + 1, self.matcher.get_error() or "it refused an allowed token")
            self.walked.append(token)
            self._consumed.append(consumed)
            self.masks.append(self._fill())
        return len(self.walked)

    def _rebuild(self) -> None:
        """A new matcher at the committed state (after a failure on tokens not taken)."""
        if self.fresh is None:
            raise RuntimeError(f"{self._broken_error} (and the row's matcher cannot be rebuilt)")
        self.matcher = self.fresh()
        self.walked, self._consumed, self._broken = [], [], None
        if not all(self.matcher.consume_token(token) for token in self.history):
            self._break(0, self.matcher.get_error() or "it refused a token it had taken")
        self.masks = [self._fill()]

    def commit(self, taken: Sequence[int]) -> None:
        """The row took `taken` this round: they become committed; the next round starts
        from the mask after them (`error` is set if the engine failed on them)."""
        walked = self.walk(taken)
        if walked < len(taken):  # the target emits only allowed tokens ...
            if self._broken is None:
                raise RuntimeError("a committed token is not allowed by the row's grammar")
            # ... allowed by masks made before a rebuild that then failed: they stand, the row ends
            self.walked += taken[walked:]
            self._consumed += [False] * (len(taken) - walked)
            self.masks.append(self._eos_only())
        self.history += [t for t, used in zip(self.walked, self._consumed) if used]
        if self._broken is not None:
            self.error = self.error or self._broken_error
            self._broken = 0
        self.walked = []
        self._consumed = []
        self.masks = [self.masks[-1]]


class Guides:
    """The grammar state of one generate call: a RowGuide per row that has a grammar.

    `grammars[b]`: a grammar.compiler.Grammar for row b, or None (unconstrained).
    `carried[b]` (optional): row b's RowGuide from an earlier batch, whose matcher state
    goes on (a row that carries on after its batch re-seated); None: a fresh one.
    """

    def __init__(
        self,
        grammars: Sequence,
        vocab_size: int,
        eos_ids: Sequence[int],
        audit: Audit | None = None,
        carried: Sequence[RowGuide | None] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        audit = audit or Audit()
        self.target_site = audit.site("target")  # verification's masks go up to the target
        self.draft_site = audit.site("draft")  # drafting's masks go up to the draft
        self.constrained = tuple(g is not None for g in grammars)
        self._grammars = list(grammars)
        self._spent = [0.0] * len(grammars)  # seconds per row not yet reported (take_seconds)
        self._depth = 0
        with self.timing([True] * len(grammars)):
            carried = carried or [None] * len(grammars)
            self.rows = [
                None
                if g is None
                else kept
                if kept is not None
                else RowGuide(g.matcher(), vocab_size, eos_ids, g.matcher)
                for g, kept in zip(grammars, carried)
            ]
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

    def errors(self) -> dict[int, str]:
        """Rows whose committed tokens the grammar engine failed on: row -> its message.
        Their grammars are marked failed (grammar.compiler.Grammar.failed): their shared
        lexer is spent, and later requests for them are refused before any token."""
        out = {b: g.error for b, g in enumerate(self.rows) if g is not None and g.error is not None}
        for b, message in out.items():
            if getattr(self._grammars[b], "failed", False) is None:
                self._grammars[b].failed = message
        return out

    def take_seconds(self) -> list[float]:
        """Seconds charged to each row since the last call (0 for rows without a grammar)."""
        spent, self._spent = self._spent, [0.0] * len(self._spent)
        return spent
