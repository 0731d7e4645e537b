"""One decoding round over a batch: propose -> score -> verify -> commit -> record.

`commit` is the only step that changes rows and the target's cache bookkeeping;
`verify` is the pure function of ssdlocal.core.verify. The Round holds what stays the
same for a whole generate call (runner, drafter, sampling, random stream, stats).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import Event, RoundEvent, TokenOrigin, TokensEvent
from ssdlocal.core.sampling import logits_to_probs, sample
from ssdlocal.core.sequence import Row
from ssdlocal.core.stats import SpecStats
from ssdlocal.core.verify import verify
from ssdlocal.draft.base import Proposal


@dataclass(frozen=True)
class Scored:
    """The target's view of one round's proposal."""

    p: torch.Tensor  # [B, K+1, V] target probabilities at each draft position and the next
    drafts: torch.Tensor  # [B, K] long, draft tokens (0 past n_draft)
    n_draft: torch.Tensor  # [B] long, real drafts per row


@dataclass
class Round:
    """Everything one generate call's rounds share."""

    runner: object  # backends.base.Runner of the target
    forward: Callable  # runner.feed with out-of-memory errors mapped
    drafter: object | None  # draft.base.Drafter, None for AR
    rows: list[Row]
    k: int  # drafts per round (0 for AR)
    vocab_size: int
    params: SamplingParams
    generator: torch.Generator
    stats: SpecStats

    def run(self, index: int) -> Iterator[Event]:
        """One round over every active row; yields TokensEvents, then one RoundEvent."""
        active = [r.active for r in self.rows]
        t0 = time.perf_counter()
        proposal = self.propose(active)
        t1 = time.perf_counter()
        scored = self.score(proposal, active)
        n_acc, bonus = self.verify(scored, proposal)
        t2 = time.perf_counter()
        emitted, origins = self.commit(proposal, n_acc, bonus, active)
        self.record(proposal, scored, n_acc, emitted, active, t1 - t0, t2 - t1)
        yield from token_events(self.rows, emitted, origins)
        yield self.round_event(index, proposal, scored, n_acc, active)

    # ------------------------------------------------------------------ steps
    def propose(self, active: list[bool]) -> Proposal:
        if self.drafter is None:
            return Proposal(tokens=[[] for _ in self.rows], q=None)
        return self.drafter.propose([r.tokens for r in self.rows], active)

    def score(self, proposal: Proposal, active: list[bool]) -> Scored:
        """The target scores every row's pending tokens + drafts in one forward."""
        batch, width = len(self.rows), self.k + 1
        pending = [
            self.runner.pending(b, r.tokens) if active[b] else [] for b, r in enumerate(self.rows)
        ]
        logits = self.forward([pending[b] + proposal.tokens[b] for b in range(batch)])
        stacked = torch.zeros(batch, width, self.vocab_size)  # [B, K+1, V]
        drafts = torch.zeros(batch, self.k, dtype=torch.long)  # [B, K]
        n_draft = torch.zeros(batch, dtype=torch.long)  # [B]
        for b in range(batch):
            if not active[b]:
                continue
            n = len(proposal.tokens[b])
            scored = logits[b][len(pending[b]) - 1 :]  # [n+1, V]
            stacked[b, : n + 1] = scored
            stacked[b, n + 1 :] = scored[-1]
            drafts[b, :n] = torch.tensor(proposal.tokens[b], dtype=torch.long)
            n_draft[b] = n
        return Scored(logits_to_probs(stacked, self.params), drafts, n_draft)  # p [B, K+1, V]

    def verify(self, scored: Scored, proposal: Proposal) -> tuple[list[int], list[int]]:
        """(accepted drafts per row, bonus token per row)."""
        if self.k == 0:  # AR: the bonus is the next token
            bonus = sample(scored.p[:, 0], self.generator)  # [B]
            return [0] * len(self.rows), bonus.tolist()
        verdict = verify(scored.p, scored.drafts, proposal.q, self.generator, scored.n_draft)
        return verdict.n_accepted.tolist(), verdict.bonus.tolist()

    def commit(
        self, proposal: Proposal, n_acc: list[int], bonus: list[int], active: list[bool]
    ) -> tuple[list[list[int]], list[list[str]]]:
        """Append accepted drafts + bonus to each row (stopping rules apply) and tell the
        target runner and the drafter. Returns the tokens each row took and their origins."""
        emitted: list[list[int]] = []
        origins: list[list[str]] = []
        for b, row in enumerate(self.rows):
            if not active[b]:
                emitted.append([])
                origins.append([])
                continue
            hit = bool(proposal.cache_hit[b]) if proposal.cache_hit is not None else False
            draft_origin = TokenOrigin.DRAFT_HIT if hit else TokenOrigin.DRAFT
            new = proposal.tokens[b][: n_acc[b]] + [bonus[b]]
            kinds = [draft_origin] * n_acc[b] + [TokenOrigin.TARGET]
            taken = [tok for tok in new if row.append(tok)]
            emitted.append(taken)
            origins.append(kinds[: len(taken)])
            self.runner.sync(b, row.tokens)
        if self.drafter is not None:
            self.drafter.observe(
                [r.tokens for r in self.rows], n_acc, bonus, [r.active for r in self.rows]
            )
        return emitted, origins

    def record(self, proposal, scored, n_acc, emitted, active, draft_s, verify_s) -> None:
        stats = self.stats
        for b in range(len(self.rows)):
            if not active[b]:
                continue
            stats.tokens += len(emitted[b])
            stats.record_row(int(scored.n_draft[b]), n_acc[b], len(emitted[b]))
            if proposal.cache_hit is not None:
                stats.record_ssd_row(bool(proposal.cache_hit[b]), len(emitted[b]))
        if proposal.draft_busy_s is not None:
            stats.draft_busy_s += proposal.draft_busy_s
        stats.rounds += 1
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        if proposal.cache_hit is not None:
            stats.ssd_rounds += 1
            stats.cache_hits += int(all(h for h, a in zip(proposal.cache_hit, active) if a))
            if proposal.backup:
                stats.backup_used[proposal.backup] = stats.backup_used.get(proposal.backup, 0) + 1

    def round_event(self, index, proposal, scored, n_acc, active) -> RoundEvent:
        live = [b for b in range(len(self.rows)) if active[b]]
        hits = proposal.cache_hit
        return RoundEvent(
            index,
            tuple(int(scored.n_draft[b]) for b in live),
            tuple(n_acc[b] for b in live),
            tuple(hits[b] for b in live) if hits is not None else None,
            proposal.backup,
            self.stats.snapshot(),
            rows=tuple(live),
        )


def token_events(rows, emitted, origins) -> Iterator[TokensEvent]:
    """One TokensEvent per row that took tokens, with the text now safe to show."""
    for b, row in enumerate(rows):
        if emitted[b]:
            text = row.take_text_delta()
            yield TokensEvent(b, tuple(emitted[b]), text, tuple(origins[b]), row.finish_reason)
