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
moves; the loop keeps none of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from ssdlocal.backends.base import SlotLayout
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import Mode, SpecConfig, repeatable
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
from ssdlocal.core.hostsync import WaitsSince
from ssdlocal.core.sequence import Row
from ssdlocal.core.stats import RunStats
from ssdlocal.engine.ahead import ReadAhead
from ssdlocal.engine.auto import rechecked
from ssdlocal.engine.prefill import PrefillStopped, read_prompts, store_prefixes
from ssdlocal.engine.request import Inbox, Request, RowSampling
from ssdlocal.engine.round import Round, token_events
from ssdlocal.engine.shape import make_shaper
from ssdlocal.engine.warm import warm_up


@dataclass(eq=False)
class Seat:
    """One row of the running batch: the request it serves, its row, its grammar matcher
    (grammar.guide.RowGuide, carried across re-seats; None without a grammar)."""

    request: Request
    row: Row
    guide: object = None


def counted(stats: RunStats, events: Iterator[Event]) -> Iterator[Event]:
    """Count every event; each RoundEvent leaves with the metrics so far."""
    for event in events:
        stats.consume(event)
        yield replace(event, snapshot=LazySnapshot(stats.snapshot)) if isinstance(event, RoundEvent) else event


class Loop:
    """Seatings of one engine over a stream of requests (see the module docstring).

    `engine`: the Engine (its runner, drafter factory, caches). `spec`: the speculation
    settings as given (resolved per seating). `inbox` None: one seating of the requests
    `run` gets; else re-seats from the inbox, at most `max_batch` rows, until the inbox is
    closed and every row is done. `token` stops everything after the current round."""

    def __init__(
        self,
        engine,
        spec: SpecConfig,
        reason: str,
        token: CancelToken,
        *,
        progress: Callable[[PrefillProgress], None] | None = None,
        inbox: Inbox | None = None,
        max_batch: int | None = None,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.reason = reason
        self.token = token
        self.progress = progress
        self.inbox = inbox
        self.max_batch = max_batch
        self.generators: dict = {}  # sampling settings -> generator, across seatings
        self.seats: list[Seat] = []  # the latest seating's (generate: every row, in prompt order)
        self.round_index = 0
        self.ahead = ReadAhead(engine.runner)  # serving: waiting prompts read between rounds
        self.round_s = 0.0  # the last round's wall time (what reading ahead may take per boundary)

    def k(self, spec: SpecConfig) -> int:
        return spec.k if spec.mode is not Mode.AR else 0

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Sequence[Request], stats: RunStats | None = None) -> Iterator[Event]:
        """Seat `requests` (and, serving, what the inbox brings) and run until done.

        `stats` given (generate): every event is counted there. None (serving): each
        seating counts its own and ends with a SeatingDoneEvent of its snapshot."""
        eng, pinned = self.engine, None
        if self.inbox is not None:  # serving: the steps every join and leave will take, captured now
            warm_up(eng, eng._resolved(self.spec), self.max_batch or 1)
        if eng._resolved(self.spec).mode is Mode.SSD and eng._cpu_plan is not None:  # the worker has the other cores
            pinned = eng._cpu_plan.apply_to_this_process(pin_affinity=eng.config.pin_cpus)
        try:
            carried: list[Seat] = []
            joining = list(requests)
            while not self.token.cancelled:
                if self.inbox is not None:
                    self._cancel(carried, self.inbox.take_cancels())
                    carried = [s for s in carried if s.row.active]
                    room = (self.max_batch or 1 << 30) - len(carried) - len(joining)
                    seated = [s.request for s in carried] + joining
                    ready = self._ready if carried else None  # nobody streams: read whole prompts now
                    joining += self.inbox.take(room, seated, ready) if room > 0 else []
                if not carried and not joining:
                    if self.inbox is None or (self.inbox.closed and not self.inbox.waiting()):
                        return
                    self.inbox.wait(0.5)
                    continue
                seating_stats = stats if stats is not None else self._new_stats(carried, joining)
                yield from counted(seating_stats, self._seating(carried, joining, seating_stats))
                if stats is None:
                    yield SeatingDoneEvent(seating_stats.snapshot())
                carried = [s for s in self.seats if s.row.active]
                joining = []
                if self.inbox is None:
                    return
        finally:
            if pinned is not None:
                pinned.restore()

    def _new_stats(self, carried, joining) -> RunStats:
        spec = self._spec([s.request for s in carried] + list(joining))
        return RunStats(k=self.k(spec), mode=spec.mode.value, mode_reason=self.reason)

    def _spec(self, requests: Sequence[Request]) -> SpecConfig:
        """This seating's settings: repeatable ones (core.config.repeatable) when it serves
        a seeded sample (an exclusive sampled request), resolved by the engine."""
        spec = self.spec
        if any(r.exclusive is not None and not r.params.greedy for r in requests):
            spec = repeatable(spec)
        return self.engine._resolved(spec)

    def _cancel(self, seats: Sequence[Seat], ids: set[int]) -> None:
        self.ahead.forget(ids)
        for seat in seats:
            if seat.request.id in ids and seat.row.active:
                seat.row.finish_reason = "cancelled"

    def _ready(self, request: Request) -> bool:
        return self.ahead.ready(request, self.ahead.chunk(self.round_s))

    def _at_boundary(self, seats: Sequence[Seat], drafter=None) -> bool:
        """Serving, at a round boundary: re-seat now when finished rows make up at least
        half of the batch, or a request may join (there is room) whose prompt is ready
        (engine.ahead); else read a chunk of the first waiting prompt that is not."""
        if self.inbox is None:
            return False
        active = [s for s in seats if s.row.active]
        if not active:
            return False
        if 2 * (len(seats) - len(active)) >= len(seats):
            return True
        room = (self.max_batch or 1 << 30) - len(active)
        joinable = self.inbox.joinable(room, [s.request for s in active]) if room > 0 else []
        chunk = self.ahead.chunk(self.round_s)
        if any(self.ahead.ready(r, chunk) for r in joinable):
            return True
        if joinable:  # none is ready: read the first one's next chunk
            self.ahead.read(joinable[0], chunk, drafter)
        return False

    def _uncounted(self, prefill: PrefillEvent, seats: Sequence[Seat]) -> PrefillEvent:
        """The seating's prefill with tokens read ahead not counted as prefix-cache hits."""
        cached = list(prefill.cached_tokens)
        for b, seat in enumerate(seats):
            before = self.ahead.cached_before(seat.request)
            if before is not None and b < len(cached):
                cached[b] = min(cached[b], before)
        self.ahead.forget([s.request.id for s in seats])
        return replace(prefill, cached_tokens=tuple(cached))

    # ------------------------------------------------------------------ one seating
    def _seating(self, carried: list[Seat], joining: list[Request], stats: RunStats) -> Iterator[Event]:
        """Seat `carried` + `joining`, read what they lack, run rounds until every row is
        done, the loop is cancelled, or (serving) a re-seat is due."""
        eng = self.engine
        if self.inbox is not None:  # first: whatever fails next fails these requests' callers
            yield SeatedEvent(
                tuple(s.request.id for s in carried) + tuple(r.id for r in joining), tuple(r.id for r in joining)
            )
        spec = self._spec([s.request for s in carried] + joining)
        k = self.k(spec)
        budgets = [eng.token_budgets([len(r.prompt)], r.params.max_new_tokens, spec)[0] for r in joining]
        new = [Seat(r, Row(list(r.prompt), r.params, eng.eos_ids, eng.tokenizer, n)) for r, n in zip(joining, budgets)]
        seats = self.seats = carried + new
        rows = [s.row for s in seats]
        fresh = [False] * len(carried) + [True] * len(new)
        num_slots = SlotLayout.for_generation(max(len(r.prompt) + r.max_new_tokens for r in rows), k).main
        eng.runner.reset(len(rows), num_slots)
        grammars = [s.request.grammar for s in seats]
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        shaper = make_shaper(
            grammars if any(g is not None for g in grammars) else None,
            len(rows),
            max(asked) if asked else None,
            eng.target.args.vocab_size,
            eng.eos_ids,
            eng.audit,
            [s.guide for s in seats],
        )
        if shaper.guides is not None:
            for seat, guide in zip(seats, shaper.guides.rows):
                seat.guide = guide
        sampling = RowSampling([s.request for s in seats], eng.runner.device, self.generators)
        drafter = eng._make_drafter(spec, sampling.params, len(rows), num_slots, shaper.guides, sampling.row_params)
        graphs_before = eng._graph_reports(drafter)
        stats.graphs_now = lambda: eng._graph_reports(drafter, graphs_before)
        stats.prefix_now = eng.prefix_reports
        stats.host_waits_now = WaitsSince(eng.audit, getattr(drafter, "host_waits", None))  # SSD: + the worker's
        completed = False
        try:
            reads = [r.prompt if f else r.tokens[:-1] for r, f in zip(rows, fresh)]
            if drafter is not None:
                drafter.read_prompts(reads)  # a draft on hardware of its own starts now
            try:
                first, prefill = read_prompts(
                    eng.runner, eng._guard, rows, sampling, self.token, self.progress, shaper, fresh
                )
            except PrefillStopped:
                for r in rows:
                    r.finish_reason = r.finish_reason or "cancelled"
                return
            shaper.end_failed(rows)  # a row whose first token ended it and broke its grammar
            yield self._uncounted(prefill, seats)
            firsts = [[r.generated[-1]] if f else [] for r, f in zip(rows, fresh)]
            yield from token_events(rows, firsts, [[TokenOrigin.TARGET]] * len(rows), shaper.first_logprobs)
            if drafter is not None:
                drafter.start(rows)
            rounds = Round(eng.runner, eng._guard, drafter, rows, k, sampling, first, shaper, eng.audit)
            rounds = rechecked(rounds, eng.choice, spec, sampling.params, stats.mode_reason)  # SD watches itself
            ran = False  # a seating runs at least one round: arrivals cannot starve the rows
            while any(r.active for r in rows) and not self.token.cancelled:
                eng._apply_row_cancels(rows)
                if self.inbox is not None:
                    self._cancel(seats, self.inbox.take_cancels())
                if not any(r.active for r in rows) or (ran and self._at_boundary(seats, drafter)):
                    break
                t0 = time.perf_counter()
                yield from rounds.run(self.round_index)
                self.round_s = time.perf_counter() - t0
                self.round_index += 1
                ran = True
            for r in rows:
                if self.token.cancelled and r.active:
                    r.finish_reason = "cancelled"
            completed = True
        except KeyboardInterrupt:
            eng.interrupted()  # before the drafter's close below, which would wait for the worker
            raise
        finally:
            stats.graphs_now = lambda final=eng._graph_reports(drafter, graphs_before): final  # frozen
            stats.host_waits_now.freeze()
            if completed:  # what the caches hold now is what later seatings and calls may start from
                store_prefixes(eng.runner, rows, drafter)
            if drafter is not None:
                drafter.close()
            for r in rows:  # prompt + answer of rows that leave: what later suffix proposals may reuse
                if self.inbox is None or not r.active:
                    eng.suffix_memory.add(r.tokens)
            if eng._memory_file is not None:
                eng._memory_file.save(eng.suffix_memory)
