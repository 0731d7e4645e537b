"""One decoding round over a batch: propose -> score -> verify -> commit -> report.

Between score and verify the call's Shaper (engine/shape.py) masks each position with what
a constrained row's grammar allows there, and reads log-probabilities when they were asked
for; commit moves the rows' grammar matchers along with the rows.

Device-resident: drafts, the target's logits, p, q and the verdict stay where the target
runs; per round one small tensor (accepted counts, bonus tokens, and the drafts when the
host does not have them) crosses to the host, which needs the tokens for text, stop
strings and events: the round's one host wait (core.hostsync counts it; under a grammar
the drafts' reads for the matcher come on top). Host -> device inputs go up through staged
uploads. `commit` is the only step that changes rows and cache lengths. Drafting and
verifying are timed on the device (core.clock: CUDA events around propose and verify, read
after the read-back, so no wait of their own), which is what the drafters' cost models and
`auto`'s re-check learn from; on the CPU the host's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ssdlocal.core.clock import DeviceClock
from ssdlocal.core.errors import DraftWorkerError, OutOfMemoryError, SSDLocalError
from ssdlocal.core.events import DraftLostEvent, Event, GrammarRound, RoundEvent, TokenOrigin, TokensEvent
from ssdlocal.core.verify import Verdict
from ssdlocal.draft.base import Proposal, RoundOutcome
from ssdlocal.engine.seating import Seating

log = logging.getLogger(__name__)
# what a drafter may fail with that costs the call its speed, never its answer
DRAFT_FAILURES = (DraftWorkerError, OutOfMemoryError, torch.OutOfMemoryError)


@dataclass(frozen=True)
class HostVerdict:
    """The verdict on the host: accepted drafts and bonus per row, the drafts as lists."""

    n_accepted: list[int]
    bonus: list[int]
    drafts: list[list[int]]


class Round:
    """The rounds of one seating (engine/seating.py: its rows, runner, drafter, sampling,
    shaper), from the prefill's first tokens.

    `last` [B] holds each row's newest committed token (the prefill's first token, then
    each bonus), which the target has not cached yet: every round feeds it first. How
    many tokens each row has cached is the runner's (`Runner.cached`): commit moves its
    lengths with the same counts on the host, so reading them needs no device read.
    """

    def __init__(self, seating: Seating, first: torch.Tensor) -> None:
        self.seating = seating
        self.runner = seating.target  # in step mode
        self.drafter = seating.drafter  # None for AR
        self.rows = seating.rows
        self.k = seating.k if self.drafter is not None else 0  # drafts per round (0 for AR)
        self.sampling = seating.sampling
        self.shaper = seating.shaper
        self.last = first  # [B] long on the target's device
        self.site = seating.audit.site("target")
        self.device = first.device
        self.clock = DeviceClock(self.device)  # draft and verify seconds as the device spent them
        batch = len(self.rows)
        self.live = torch.ones(batch, dtype=torch.bool, device=self.device)  # [B]
        none = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]
        self.no_drafts = Proposal(none[:, None][:, :0], none)  # AR: [B, 0] drafts
        self.hidden = self.drafter is not None and self.drafter.hidden is not None  # it reads hidden states
        self.failed: BaseException | None = None  # the drafter failed in this round's commit

    def plain(self) -> Round:
        """These rounds from the next one on with no drafter: plain steps over the same rows,
        caches, pending tokens and live rows (engine.auto switching to AR mid-answer)."""
        rounds = Round(replace(self.seating, drafter=None, k=0), self.last)
        rounds.live = self.live  # rows that finished keep their cache length
        return rounds

    def run(self, index: int) -> Iterator[Event]:
        """One round over every active row; yields TokensEvents, then one RoundEvent."""
        active = [r.active for r in self.rows]
        t0 = self.clock.mark()
        try:
            proposal = self.shaper.prepare(self.propose(active))  # drafts a grammar walks: on the host first
        except DRAFT_FAILURES as exc:  # the rows go on with plain steps: the same tokens
            yield self.lose_drafter(index, exc)
            proposal = self.shaper.prepare(self.no_drafts)
        t1 = self.clock.mark()
        bound = max(r.length for r in self.rows) + proposal.drafts.shape[1]  # past every row's last write
        logits = self.seating.guard(self.runner.step, self.score_ids(proposal), bound)  # [B, K+1, V]
        logits, proposal = self.shaper.mask(logits, proposal, active)  # each position: its grammar's mask
        verdict = self.sampling.verify(logits, proposal.drafts, proposal.q, proposal.n_draft)
        t2 = self.clock.mark()
        outcome = self.read_back(verdict, proposal)
        draft_s, verify_s = self.clock.seconds(t0, t1), self.clock.seconds(t1, t2)  # complete: read after the wait
        logprobs = self.shaper.round_logprobs(logits, outcome.drafts, outcome.n_accepted, outcome.bonus)
        emitted, origins = self.commit(proposal, verdict, outcome, active, draft_s, verify_s)
        yield from token_events(self.rows, emitted, origins, logprobs)
        yield self.round_event(index, proposal, outcome, emitted, active, draft_s, verify_s)
        if self.failed is not None:
            failed, self.failed = self.failed, None
            yield self.lose_drafter(index, failed)

    def lose_drafter(self, index: int, exc: BaseException) -> DraftLostEvent:
        """The drafter failed: from now on plain steps (the target has verified every token
        the rows hold, so they go on exactly as AR would), and the event saying why."""
        reason = exc.message if isinstance(exc, SSDLocalError) else f"{type(exc).__name__}: {exc}"
        log.warning("the drafter failed (%s): the rows go on with plain steps", reason)
        self.seating.drafter = None  # nothing keeps its prefixes; the loop still closes it
        self.drafter, self.k, self.hidden = None, 0, False
        return DraftLostEvent(index, reason)

    # ------------------------------------------------------------------ steps
    def propose(self, active: list[bool]) -> Proposal:
        if self.drafter is None:
            return self.no_drafts
        return self.drafter.propose(active)

    def score_ids(self, proposal: Proposal) -> torch.Tensor:
        """[B, K+1]: each row's pending token, then its drafts (padding past n_draft writes
        cache slots beyond the row's length, which later steps overwrite)."""
        if proposal.drafts.shape[1] == 0:
            return self.last[:, None]
        return torch.cat([self.last[:, None], proposal.drafts], dim=1)

    def read_back(self, verdict: Verdict, proposal: Proposal) -> HostVerdict:
        """The one device -> host transfer of the round."""
        parts = [verdict.n_accepted[:, None], verdict.bonus[:, None]]
        if proposal.tokens is None:
            parts += [proposal.n_draft[:, None], proposal.drafts]
        host = self.site.read(torch.cat(parts, dim=1))  # [B, 2 (+1+K)]
        if proposal.tokens is not None:
            drafts = proposal.tokens
        else:
            drafts = [h[3 : 3 + h[2]] for h in host]
        return HostVerdict([h[0] for h in host], [h[1] for h in host], drafts)

    def commit(
        self,
        proposal: Proposal,
        verdict: Verdict,
        outcome: HostVerdict,
        active: list[bool],
        draft_s: float = 0.0,
        verify_s: float = 0.0,
    ) -> tuple[list[list[int]], list[list[TokenOrigin]]]:
        """Append accepted drafts + bonus to each row (stopping rules apply), move the
        target's cache lengths past the pending token and the accepted drafts, and tell
        the drafter (one RoundOutcome). Returns the tokens each row took and their origins."""
        emitted: list[list[int]] = []
        origins: list[list[TokenOrigin]] = []
        for b, row in enumerate(self.rows):
            if not active[b]:
                emitted.append([])
                origins.append([])
                continue
            n = outcome.n_accepted[b]
            hit = bool(proposal.cache_hit[b]) if proposal.cache_hit is not None else False
            kinds = [TokenOrigin.DRAFT_HIT if hit else TokenOrigin.DRAFT] * n + [TokenOrigin.TARGET]
            taken = [tok for tok in outcome.drafts[b][:n] + [outcome.bonus[b]] if row.append(tok)]
            emitted.append(taken)
            origins.append(kinds[: len(taken)])
        host = [1 + (outcome.n_accepted[b] if self.k else 0) if active[b] else 0 for b in range(len(self.rows))]
        if self.k == 0:  # AR: only the pending token becomes cached
            self.runner.advance(self.live.long(), host)
        else:
            self.runner.advance(torch.where(self.live, 1 + verdict.n_accepted, 0), host)
        self.last = verdict.bonus
        self.shaper.commit(emitted, active)
        self.shaper.end_failed(self.rows)
        still = [r.active for r in self.rows]
        if still != active:  # a row finished: its cache length stays where it is
            self.live = self.site.upload(still, self.device, torch.bool)
        if self.drafter is not None:
            self._observe(
                RoundOutcome(
                    tuple(map(tuple, emitted)),
                    tuple(outcome.n_accepted),
                    tuple(outcome.bonus),
                    tuple(still),
                    verdict,
                    draft_s=draft_s,
                    verify_s=verify_s,
                    hidden=self.runner.hidden() if self.hidden else None,
                )
            )
        return emitted, origins

    def _observe(self, outcome: RoundOutcome) -> None:
        """Tell the drafter; one that fails here is lost once the round has reported (its
        tokens stand: the target verified them)."""
        assert self.drafter is not None
        try:
            self.drafter.observe(outcome)
        except DRAFT_FAILURES as exc:
            self.failed = exc

    def round_event(self, index, proposal, outcome, emitted, active, draft_s, verify_s) -> RoundEvent:
        """What this round did per active row and what it cost (core.stats counts it)."""
        live = [b for b in range(len(self.rows)) if active[b]]
        sources = proposal.sources
        constrained, mask_s = self.shaper.seconds(live)  # both None, or neither: no row has a grammar
        grammar = GrammarRound(constrained, mask_s) if constrained is not None and mask_s is not None else None
        return RoundEvent(
            index,
            tuple(len(outcome.drafts[b]) for b in live),
            tuple(outcome.n_accepted[b] for b in live),
            rows=tuple(live),
            n_emitted=tuple(len(emitted[b]) for b in live),
            draft_s=draft_s,
            verify_s=verify_s,
            sources=tuple(sources[b] for b in live) if sources is not None else None,
            ssd=proposal.ssd.pick(live) if proposal.ssd is not None else None,
            grammar=grammar,
        )


def token_events(rows, emitted, origins, logprobs=None) -> Iterator[TokensEvent]:
    """One TokensEvent per row that took tokens, with the text now safe to show (and the
    tokens' log-probabilities when its params asked for them: `logprobs` holds the most
    alternatives any row asked for, each row gets its own number)."""
    for b, row in enumerate(rows):
        if emitted[b]:
            text = row.take_text_delta()
            lps = None
            if logprobs is not None and row.params.logprobs is not None:
                lps = tuple(replace(lp, top=lp.top[: row.params.logprobs]) for lp in logprobs[b][: len(emitted[b])])
            yield TokensEvent(
                b, tuple(emitted[b]), text, tuple(origins[b]), row.finish_reason, logprobs=lps, error=row.error
            )
