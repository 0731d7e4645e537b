"""The engine's one loop: requests seated as the rows of a batch, rounds, re-seats.

`Loop.run` serves both entry points. `Engine.generate` seats its prompts once and runs
rounds until every row is done (no inbox: exactly one seating). `Engine.serve` reads an
Inbox (engine.request) at every round boundary and *re-seats* the batch when requests
may join (and it has room) or when finished rows make up at least half of it:

1. the seating ends as a generate call ends: every row's cached tokens go to the prefix
   caches (target and draft: `store_prefixes`; the SSD worker stores its rows when its
   next batch starts), and the drafter closes;
2. the new seating = the rows still active (the same `Row` objects: tokens, text, stop
   strings, budget; their grammar matchers carry on) + the joining requests' new rows;
   the target's cache is reset for it;
3. a carried row takes its tokens back from the prefix cache (`Runner.reuse`) and feeds
   only the uncached tail of its tokens but the newest, which stays its pending token
   (no draw); a new row reads its prompt and draws its first token, as a generate call;
4. a new drafter starts (the SSD worker gets a new batch start: that is how it learns
   of joins and leaves), and rounds go on.

A request whose prompt has more unread tokens than one chunk does not join at once: its
prompt is read into the prefix store a chunk per round boundary first (engine.ahead),
so the running rows keep streaming, and it joins when the rest fits one chunk.

A row's tokens therefore never depend on when it was re-seated or with whom: at T = 0 a
request gets exactly the tokens it gets alone (up to the prefix cache's own exactness:
its stored keys/values are the ones computed before). Finished rows leave at a re-seat.
Tokens each row has cached: the runner's count (`Runner.cached`), which `Round.commit`
moves; the loop keeps none of its own. The loop reaches the engine only through the
public methods of its parts (engine/parts.py: EngineParts), one seating at a time
(engine/seating.py): seat -> read the prompts -> rounds -> keep the prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SpecConfig, repeatable
from ssdlocal.core.events import (
    Event,
    LazySnapshot,
    PrefillEvent,
    PrefillProgress,
    RoundEvent,
    SeatedEvent,
    SeatingDoneEvent,
    TokenOrigin,
)
from ssdlocal.core.sequence import FinishReason, Request, Row
from ssdlocal.core.stats import RunStats
from ssdlocal.draft.base import Drafter, PromptHidden
from ssdlocal.engine.ahead import ReadAhead
from ssdlocal.engine.auto import rechecked
from ssdlocal.engine.parts import EngineParts
from ssdlocal.engine.prefill import PrefillStopped, read_prompts, store_prefixes
from ssdlocal.engine.reports import SeatingReports
from ssdlocal.engine.request import Inbox
from ssdlocal.engine.round import DRAFT_FAILURES, Round, token_events
from ssdlocal.engine.seating import Seating, seat
from ssdlocal.engine.warm import warm_up


def counted(stats: RunStats, events: Iterator[Event]) -> Iterator[Event]:
    """Count every event; each RoundEvent leaves with the metrics so far."""
    for event in events:
        stats.consume(event)
        yield replace(event, snapshot=LazySnapshot(stats.snapshot)) if isinstance(event, RoundEvent) else event


class Loop:
    """Seatings of one engine over a stream of requests (see the module docstring).

    `parts`: the engine's (EngineParts). `spec`: the speculation settings as given
    (resolved per seating). `inbox` None: one seating of the requests `run` gets; else
    re-seats from the inbox, at most `max_batch` rows, until the inbox is closed and every
    row is done. `token` stops everything after the current round. `started`: when the
    call began (its time to first token counts from there; default: each seating's start).
    After `run`, `rows` and `stats` are the latest seating's."""

    def __init__(
        self,
        parts: EngineParts,
        spec: SpecConfig,
        token: CancelToken,
        *,
        progress: Callable[[PrefillProgress], None] | None = None,
        inbox: Inbox | None = None,
        max_batch: int | None = None,
        started: float | None = None,
    ) -> None:
        self.parts = parts
        self.spec = spec
        self.reason = parts.modes.reason(spec)
        self.token = token
        self.progress = progress
        self.inbox = inbox
        self.max_batch = max_batch
        self.started = started
        self.generators: dict = {}  # sampling settings -> generator, across seatings
        self.rows: list[Row] = []  # the latest seating's (generate: every row, in prompt order)
        self.stats: RunStats | None = None  # the latest seating's
        self.round_index = 0
        self.ahead = ReadAhead(parts.target)  # serving: waiting prompts read between rounds
        self.round_s = 0.0  # the last round's wall time (what reading ahead may take per boundary)

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Sequence[Request]) -> Iterator[Event]:
        """Seat `requests` (and, serving, what the inbox brings) and run until done; each
        seating counts its own stats (serving: it ends with a SeatingDoneEvent of them)."""
        if self.inbox is not None:  # serving: the steps every join and leave will take, captured now
            warm_up(self.parts, self.parts.modes.resolved(self.spec), self.max_batch or 1)
        with self.parts.drafts.pinned(self.parts.modes.resolved(self.spec)):  # SSD on the CPU: our cores
            carried: list[Row] = []
            joining = list(requests)
            while not self.token.cancelled:
                if self.inbox is not None:
                    self._cancel(carried, self.inbox.take_cancels())
                    carried = [r for r in carried if r.active]
                    room = (self.max_batch or 1 << 30) - len(carried) - len(joining)
                    seated = [*_requests(carried), *joining]
                    ready = self._ready if carried else None  # nobody streams: read whole prompts now
                    joining += self.inbox.take(room, seated, ready) if room > 0 else []
                if not carried and not joining:
                    if self.inbox is None or (self.inbox.closed and not self.inbox.waiting()):
                        return
                    self.inbox.wait(0.5)
                    continue
                yield from self._seating(carried, joining)
                carried = [r for r in self.rows if r.active]
                joining = []
                if self.inbox is None:
                    return

    def _spec(self, requests: Sequence[Request]) -> SpecConfig:
        """This seating's settings: repeatable ones (core.config.repeatable) when it serves
        a seeded sample (an exclusive sampled request), resolved by the engine."""
        spec = self.spec
        if any(r.exclusive is not None and not r.params.greedy for r in requests):
            spec = repeatable(spec)
        return self.parts.modes.resolved(spec)

    def _cancel(self, rows: Sequence[Row], ids: set[int]) -> None:
        self.ahead.forget(ids)
        for row in rows:
            if row.request is not None and row.request.id in ids:
                row.finish(FinishReason.CANCELLED)

    def _ready(self, request: Request) -> bool:
        return self.ahead.ready(request, self.ahead.chunk(self.round_s))

    def _at_boundary(self, rows: Sequence[Row], drafter: Drafter | None) -> bool:
        """Serving, at a round boundary: re-seat now when finished rows make up at least
        half of the batch, or a request may join (there is room) whose prompt is ready
        (engine.ahead); else read a chunk of the first waiting prompt that is not."""
        if self.inbox is None:
            return False
        active = [r for r in rows if r.active]
        if not active:
            return False
        if 2 * (len(rows) - len(active)) >= len(rows):
            return True
        room = (self.max_batch or 1 << 30) - len(active)
        joinable = self.inbox.joinable(room, _requests(active)) if room > 0 else []
        chunk = self.ahead.chunk(self.round_s)
        if any(self.ahead.ready(r, chunk) for r in joinable):
            return True
        if joinable:  # none is ready: read the first one's next chunk
            self.ahead.read(joinable[0], chunk, drafter)
        return False

    def _uncounted(self, prefill: PrefillEvent, rows: Sequence[Row]) -> PrefillEvent:
        """The seating's prefill with tokens read ahead not counted as prefix-cache hits."""
        cached = list(prefill.cached_tokens)
        for b, request in enumerate(_requests(rows)):
            before = self.ahead.cached_before(request)
            if before is not None and b < len(cached):
                cached[b] = min(cached[b], before)
        self.ahead.forget([r.id for r in _requests(rows)])
        return replace(prefill, cached_tokens=tuple(cached))

    # ------------------------------------------------------------------ one seating
    def _seating(self, carried: list[Row], joining: list[Request]) -> Iterator[Event]:
        """Seat `carried` + `joining`, read what they lack, run rounds until every row is
        done, the loop is cancelled, or (serving) a re-seat is due."""
        if self.inbox is not None:  # first: whatever fails next fails these requests' callers
            yield SeatedEvent(tuple(r.id for r in [*_requests(carried), *joining]), tuple(r.id for r in joining))
        spec = self._spec([*_requests(carried), *joining])
        seating = seat(self.parts, carried, joining, spec, self.generators)
        self.rows = seating.rows
        reports = SeatingReports(self.parts.target, seating.drafter, self.parts.drafts, self.parts.audit)
        started = self.started if self.started is not None else time.perf_counter()
        self.started = None  # a later seating counts from its own start
        stats = self.stats = RunStats(seating.k, spec.mode.value, self.reason, started=started, sources=reports)
        yield from counted(stats, self._run(seating, reports))
        if self.inbox is not None:
            yield SeatingDoneEvent(stats.snapshot())

    def _run(self, seating: Seating, reports: SeatingReports) -> Iterator[Event]:
        """The seating's prompts, then its rounds; what the caches hold afterwards is kept."""
        parts, rows, drafter = self.parts, seating.rows, seating.drafter
        completed = False
        try:
            lost = None  # a drafter that fails before the first round is lost (core.events.DraftLostEvent)
            if drafter is not None:  # a draft on hardware of its own starts reading now
                lost = _attempt(
                    lambda: drafter.read_prompts(
                        [r.prompt if f else r.tokens[:-1] for r, f in zip(rows, seating.fresh)]
                    )
                )
            try:
                first, prefill = read_prompts(seating, self.token, self.progress)
            except PrefillStopped:
                for r in rows:
                    r.finish(FinishReason.CANCELLED)
                return
            seating.shaper.end_failed(rows)  # a row whose first token ended it and broke its grammar
            yield self._uncounted(prefill, rows)
            firsts = [[r.generated[-1]] if f else [] for r, f in zip(rows, seating.fresh)]
            yield from token_events(rows, firsts, [[TokenOrigin.TARGET]] * len(rows), seating.shaper.first_logprobs)
            if drafter is not None and lost is None:
                hidden = PromptHidden(parts.target.hidden(), *seating.read) if drafter.hidden else None
                lost = _attempt(lambda: drafter.start(rows, hidden))
            rounds = Round(seating, first)
            if lost is not None:
                yield rounds.lose_drafter(self.round_index, lost)
            rounds = rechecked(rounds, parts.modes.choice, seating.spec, seating.sampling.params, self.reason)
            ran = False  # a seating runs at least one round: arrivals cannot starve the rows
            while any(r.active for r in rows) and not self.token.cancelled:
                parts.cancels.apply(rows)
                if self.inbox is not None:
                    self._cancel(rows, self.inbox.take_cancels())
                if not any(r.active for r in rows) or (ran and self._at_boundary(rows, drafter)):
                    break
                t0 = time.perf_counter()
                yield from rounds.run(self.round_index)
                self.round_s = time.perf_counter() - t0
                self.round_index += 1
                ran = True
            if self.token.cancelled:
                for r in rows:
                    r.finish(FinishReason.CANCELLED)
            completed = True
        except KeyboardInterrupt:
            parts.drafts.interrupted()  # before the drafter's close below, which would wait for the worker
            raise
        finally:
            reports.freeze()
            if completed:  # what the caches hold now is what later seatings and calls may start from
                store_prefixes(seating)
            if drafter is not None:
                drafter.close()
            # prompt + answer of rows that leave: what later suffix proposals may reuse
            parts.suffix.remember(r for r in rows if self.inbox is None or not r.active)


def _attempt(call: Callable[[], None]) -> BaseException | None:
    """call(); a drafter's failure is returned (the rows go on without it), anything else raised."""
    try:
        call()
    except DRAFT_FAILURES as exc:
        return exc
    return None


def _requests(rows: Sequence[Row]) -> list[Request]:
    """The requests `rows` serve (every row the loop seats has one)."""
    return [r.request for r in rows if r.request is not None]
