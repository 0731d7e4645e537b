"""Rolling a recurrent or hybrid model's rows back on llama.cpp (Mamba-like, Qwen3.5's Gated DeltaNet).

Such a model keeps one state per sequence, not one per position, so llama.cpp cannot drop
a sequence's tail (llama_memory_seq_rm of a partial range fails). Rows are cut back after
rejected drafts in three ways, cheapest first (measured per round by
scripts/llamacpp_rollback.py; docs/architecture.md §2):

1. llama.cpp's own snapshots (context parameter n_rs_seq = SNAPSHOTS): a llama_decode
   keeps the state after each of its last tokens, and one seq_rm rolls back up to
   SNAPSHOTS of the row's tokens of its last llama_decode call, once. A target's verify of
   K+1 tokens is cut this way: nothing is decoded again.
2. A checkpoint: the row's recurrent state saved as bytes (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
   before a run of one-token decodes (a draft's steps), before every decode of a tree
   runner (SSD's branches start at earlier positions), and after any cut; restoring it
   drops the attention cells past it and decodes the tokens up to the cut again.
3. From nothing: the row's cells dropped and its tokens decoded again (no checkpoint at or
   before the cut; not reached by the engine's rounds).

A mixin of LlamaCppRunner: it owns `_checkpoints` and `_spans` (what each row's last decode
covered, and whether its snapshots are still unused) and uses the runner's context, `_kv`
and `_decode` (which it does not define). A checkpoint holds while the row's tokens before
it stay: every change below it (`_restore` past it, a row emptied or copied into:
`_forget_row`) drops it. Knows nothing about speculation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

SNAPSHOTS = 8  # llama.cpp's n_rs_seq: tokens of a decode that one seq_rm may give back (K <= 8 verifies)


@dataclass(frozen=True)
class Checkpoint:
    position: int  # the row's cached tokens when it was taken
    state: bytes  # llama.cpp's recurrent state of the row then (partial sequence state)


@dataclass
class Span:
    start: int  # the row's first position this decode wrote
    end: int  # one past its last
    fresh: bool = True  # its snapshots were not used yet (llama.cpp allows one rollback)


class RecurrentRows:
    """Cutting rows of a model whose memory is recurrent (`self.recurrent`)."""

    # set by LlamaCppRunner
    lib: object
    tree: bool
    alike: bool
    _ctx: object
    _kv: list[list[int]]
    _snapshots: int
    _checkpoints: dict[int, Checkpoint]
    _spans: dict[int, Span]
    _singles: dict[int, bool]  # row -> its last decode was one token
    rollbacks: dict[str, int]  # cuts by way: "snapshot", "checkpoint", "scratch" (and tokens decoded again: "again")

    def _before_decode(self, row: int, n_new: int, cut: bool) -> None:
        """Take row `row`'s checkpoint before it decodes `n_new` tokens when a later cut
        may reach behind what this decode's snapshots cover: at the start of a run of
        one-token decodes, after a cut (`cut`), before any decode of a tree runner."""
        kv = self._kv[row]
        single = n_new == 1
        due = (
            self.tree
            or self.alike  # steps go in several calls: a cut may reach behind the last one's snapshots
            or cut
            or (single and not self._singles.get(row, False))
            or row not in self._checkpoints
        )
        self._singles[row] = single
        if kv and due:
            self._checkpoints[row] = Checkpoint(len(kv), self.lib.seq_state(self._ctx, row, partial=True))

    def _after_call(self, positions, seqs) -> None:
        """One llama_decode wrote `positions` of `seqs`: llama.cpp's snapshots now cover the
        rows' tokens of this call (and nothing before it)."""
        reach: dict[int, tuple[int, int]] = {}
        for pos, seq in zip(positions, seqs):
            if seq < len(self._kv):  # rows; branches and the reading sequence are never cut
                lo, hi = reach.get(seq, (pos, pos + 1))
                reach[seq] = (min(lo, pos), max(hi, pos + 1))
        for seq, (lo, hi) in reach.items():
            self._spans[seq] = Span(lo, hi)

    def _forget_row(self, row: int) -> None:
        """Row `row`'s sequence was replaced (emptied, copied into): nothing saved for it
        holds any more."""
        self._checkpoints.pop(row, None)
        self._spans.pop(row, None)
        self._singles.pop(row, None)

    def _cut(self, row: int, n: int) -> None:
        """Row `row`'s sequence keeps its first `n` cached tokens (and its state after them)."""
        kv = self._kv[row]
        if n >= len(kv):
            return
        span = self._spans.get(row)
        back = len(kv) - n
        if (
            span is not None
            and span.fresh
            and span.end == len(kv)
            and back <= min(self._snapshots, span.end - span.start - 1)
            and self.lib.seq_rm(self._ctx, row, n, -1)
        ):
            span.fresh = False  # llama.cpp's rollback is single-use until the next decode
            del kv[n:]
            self.rollbacks["snapshot"] += 1
            return
        self._restore(row, n)

    def _restore(self, row: int, n: int) -> None:
        """Row `row` becomes its first `n` cached tokens from its checkpoint (or from
        nothing): the saved state set back, the attention cells past it dropped, the
        tokens up to `n` decoded again."""
        kv = self._kv[row]
        tokens = kv[:n]
        point = self._checkpoints.get(row)
        if point is not None and point.position <= n:
            self.lib.set_seq_state(self._ctx, row, point.state, partial=True)
            self.lib.seq_rm(self._ctx, row, point.position, -1)  # attention cells only: the state is at position-1
            start = point.position
            self.rollbacks["checkpoint"] += 1
        else:
            log.debug("row %d: no checkpoint at or before %d, decoding its %d tokens again", row, n, n)
            self.lib.seq_rm(self._ctx, row, -1, -1)
            self._checkpoints.pop(row, None)
            start = 0
            self.rollbacks["scratch"] += 1
        del kv[start:]
        self.rollbacks["again"] += n - start
        self._spans.pop(row, None)
        if start < n:
            self._decode(tokens[start:n], list(range(start, n)), [row] * (n - start), [False] * (n - start))
            kv.extend(tokens[start:n])

    def _state_into(self, row: int, seq: int, n: int) -> None:
        """Sequence `seq` (empty) becomes row `row`'s first `n` cached tokens: the row's
        cells shared (seq_cp) where its state is right there, else its checkpoint's state
        and the tokens after it decoded into `seq` (a tree branch starting inside the row)."""
        kv = self._kv[row]
        if n == len(kv):
            self.lib.seq_cp(self._ctx, row, seq, 0, n)  # the recurrent state goes whole: it is at n
            return
        point = self._checkpoints.get(row)
        start = 0
        if point is not None and point.position <= n:
            start = point.position
            self.lib.seq_cp(self._ctx, row, seq, 0, start)  # attention cells before the checkpoint
            self.lib.set_seq_state(self._ctx, seq, point.state, partial=True)
        if start < n:
            self._decode(kv[start:n], list(range(start, n)), [seq] * (n - start), [False] * (n - start))
