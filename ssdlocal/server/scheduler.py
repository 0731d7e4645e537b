"""One thread owns the Engine and serves jobs through continuous batching.

A request becomes a Job with a row per choice; each row is an engine.request.Request
that joins the engine's running batch at a round boundary (`Engine.serve`: at most
`max_batch` rows; a row waits in arrival order while the batch is full) and leaves when
done, so a short request no longer waits for a long answer to end. Rows of one batch may
sample differently (the engine verifies per group of equal settings; an SD draft model
draws each row its own way, SSD's worker pre-speculates with the batch's first setting,
which costs other rows accepted drafts, never exactness). A sampled request with a seed
of its own runs alone (joins nothing, nobody joins it) with repeatable speculation
settings, so a seeded sample repeats. The thread routes each row's tokens to its job's asyncio queue (the engine's
SeatedEvent says which request each row serves), answers a job as soon as all its rows
finish, cancels the rows of a job whose client left (they finish "cancelled" at the next
round boundary), and survives a failed engine call: the jobs seated in it get the error,
the others go on in a new serving loop. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ssdlocal.backends import registry
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import (
    LazySnapshot,
    PrefillEvent,
    RoundEvent,
    SeatedEvent,
    SeatingDoneEvent,
    TokensEvent,
)
from ssdlocal.core.metrics import Metrics
from ssdlocal.core.stats import RunStats
from ssdlocal.engine.request import Inbox
from ssdlocal.core.sequence import FinishReason, Request

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass(frozen=True)
class Chunk:
    """New tokens of one choice; `finish_reason` set on its last chunk."""

    choice: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    logprobs: tuple | None = None  # core.events.TokenLogprob per token, when asked for
    error: str | None = None  # with finish_reason "error": why the choice could not go on


@dataclass(frozen=True)
class Finished:
    """A job's end: per choice (text, token ids, finish reason), and its stats."""

    choices: tuple[tuple[str, tuple[int, ...], FinishReason], ...]
    stats: dict[str, Any]
    cached: tuple[int, ...] = ()  # per choice: prompt tokens taken from the prefix cache
    logprobs: tuple[tuple, ...] | None = None  # per choice: its tokens' TokenLogprobs (when asked for)
    errors: tuple[str | None, ...] = ()  # per choice: why it ended with finish_reason "error"


@dataclass(frozen=True)
class Failed:
    error: BaseException


class ServerShuttingDown(Exception):
    """The server stopped before the job could run."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


@dataclass(eq=False)
class Job:
    """One request: a row per choice (prompt token ids), its params, its answer queue.
    The engine thread keeps each choice's tokens, text and stats here while its rows run."""

    rows: tuple[tuple[int, ...], ...]
    params: SamplingParams
    seeded: bool
    loop: asyncio.AbstractEventLoop
    stream: bool = True  # push each Chunk (else only the answer: fewer wake-ups of the loop)
    budgets: tuple[int | None, ...] | None = None  # per-row max_new_tokens (default: params')
    grammar: object = None  # grammar.compiler.Grammar every row follows (each with a matcher of its own)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the client side; the engine thread acts on it
    done: bool = False  # engine thread: answered (Finished / Failed) or dropped

    def __post_init__(self) -> None:
        n = len(self.rows)
        self.stats = RunStats(rows=frozenset(range(n)))  # core.stats over its rows, keyed by choice
        self.text = [""] * n
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[FinishReason | None] = [None] * n
        self.errors: list[str | None] = [None] * n  # per choice: its grammar's failure
        self.cached = [0] * n  # per choice: prompt tokens the prefix cache held
        self.batch_size = 0  # rows of the largest batch it shared
        self.overlapped = False  # another job was waiting or running while it was
        self.joined_at: float | None = None  # when its first row joined the running batch
        self.inbox: Inbox | None = None  # where its requests wait (set by Scheduler.submit)
        self.requests: list[Request] = self.make_requests()

    def make_requests(self) -> list[Request]:
        """A Request per choice. Each row keeps its own budget. A seeded sampled job runs
        alone, its rows on one random stream of their own (row i > 0 seeded apart from row
        0, so rows do not repeat each other); an unseeded sample gets a fresh seed."""
        budgets = self.budgets or (self.params.max_new_tokens,) * len(self.rows)
        sampled, out = not self.params.greedy, []
        base = self.params if self.seeded or not sampled else replace(self.params, seed=random.randrange(2**31))
        for c, (prompt, budget) in enumerate(zip(self.rows, budgets)):
            params = replace(base, max_new_tokens=budget)
            if self.seeded and sampled and c:
                params = replace(params, seed=params.stream_seed(c * _ROW_SEED_STRIDE))
            alone = self.seeded and sampled
            out.append(
                Request(
                    tuple(prompt),
                    params,
                    self.grammar,
                    exclusive=("seeded", self.id) if alone else None,
                    random_key=self.id if alone else None,
                )
            )
        return out

    def cancel(self) -> None:
        """The client left: its rows leave at the next round boundary (waiting ones at once)."""
        self.cancelled = True
        if not self.done and self.inbox is not None:
            for request in self.requests:
                self.inbox.cancel(request.id)

    def push(self, item: Chunk | Finished | Failed) -> None:
        """Hand an item to the job's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            self.cancelled = True


_ROW_SEED_STRIDE = 0x9E3779B1  # seeds of a seeded job's later rows: far from the drafter's offsets


class Scheduler:
    """Serves jobs on one engine in a thread of its own; `submit` from any thread."""

    def __init__(self, engine, metrics, *, mode: str, max_batch: int = 8, batch_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.metrics = metrics
        self.mode = mode
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s  # an idle engine waits this long for requests sent together
        self.inbox = Inbox(gather_s=batch_wait_s)
        self._lock = threading.Lock()
        self._owners: dict[int, tuple[Job, int]] = {}  # request id -> (job, choice), until the job ends
        self._jobs: dict[int, Job] = {}  # job id -> job, until it ends
        self._seated: list[tuple[Job, int] | None] = []  # row b of the running batch -> (job, choice)
        self._stopping = False
        self._token = CancelToken()
        self._graphs: Mapping | None = None  # captured-step counts of the latest seating
        self._snapshot: LazySnapshot | None = None  # the metrics as of the round being handled
        self._seating_started = time.perf_counter()
        self._seatings = [0, 0]  # seatings begun, ended (the engine thread writes both)
        self._thread = threading.Thread(target=self._loop, name="ssdlocal-engine", daemon=True)

    # ------------------------------------------------------------------ client side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def settled(self) -> bool:
        """Every seating begun has ended: the batches of answers already sent have stored
        their prefixes and been counted in the metrics. (A request sent but not yet seated
        is not waited for.)"""
        with self._lock:
            return self._seatings[0] == self._seatings[1]

    @property
    def running(self) -> int:
        """Jobs with rows in the running batch."""
        with self._lock:
            return len({id(o[0]) for o in self._seated if o is not None and not o[0].done})

    @property
    def waiting(self) -> int:
        """Jobs none of whose rows has joined yet."""
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.joined_at is None and not (job.done or job.cancelled))

    def submit(
        self,
        rows: Sequence[Sequence[int]],
        params: SamplingParams,
        seeded: bool,
        *,
        stream: bool = True,
        budgets: Sequence[int | None] | None = None,
        grammar=None,
    ) -> Job:
        """A job for these rows; `budgets`: each row's max_new_tokens (None: the room left
        in the context), instead of params.max_new_tokens for all; `grammar`: what every
        row's answer must follow (rows of other jobs in the same batch are not affected)."""
        job = Job(
            tuple(tuple(r) for r in rows),
            params,
            seeded,
            asyncio.get_running_loop(),
            stream,
            tuple(budgets) if budgets is not None else None,
            grammar,
        )
        with self._lock:
            if self._stopping:
                job.push(Failed(ServerShuttingDown()))
                return job
            for other in self._jobs.values():  # they may share a batch, or its cells (read ahead)
                if not other.done:
                    other.overlapped = job.overlapped = True
            self._jobs[job.id] = job
            for choice, request in enumerate(job.requests):
                self._owners[request.id] = (job, choice)
            job.inbox = self.inbox
        self.inbox.add(*job.requests)
        self._gauges()
        return job

    def stop(self, timeout: float = 10.0) -> None:
        """Fail every job not answered yet, stop the serving loop, and join the thread."""
        with self._lock:
            self._stopping = True
        self.inbox.close()
        self._token.cancel()
        self.engine.cancel()
        self._fail_all(ServerShuttingDown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        # CUDA's current device is per thread: the engine runs here, not where it was made
        registry.claim_device(self.engine.config.target.device)
        while not self._stopping:
            try:
                for event in self.engine.serve(self.inbox, max_batch=self.max_batch, cancel=self._token):
                    self._event(event)
            except Exception as exc:  # one failed batch must not stop the server
                log.warning("generate failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                self._fail_seated(exc)
                with self._lock:
                    self._seatings[1] = self._seatings[0]
                continue
            break
        self._fail_all(ServerShuttingDown())

    def _event(self, event) -> None:
        self._drop_cancelled()
        if isinstance(event, SeatedEvent):
            self._seat(event)
        elif isinstance(event, PrefillEvent):
            self._prefill(event)
        elif isinstance(event, TokensEvent):
            self.metrics.record_tokens(len(event.token_ids))
            self._tokens(event)
        elif isinstance(event, RoundEvent):
            self._snapshot = event.snapshot  # read (lazily) only if a request finishes now
            for job, rows in self._jobs_seated():
                job.stats.consume(replace(event, rows=tuple(rows.get(b, -1) for b in event.rows)))
            self._answer_finished()
        elif isinstance(event, SeatingDoneEvent):
            self._graphs, self._snapshot = event.stats.graphs or self._graphs, None
            self._answer_finished()
            self._snapshot = None
            self.metrics.record_batch(event.stats, time.perf_counter() - self._seating_started)
            with self._lock:
                self._seatings[1] += 1

    def _seat(self, event: SeatedEvent) -> None:
        now = time.perf_counter()
        self._seating_started = now
        with self._lock:
            self._seated = [self._owners.get(rid) for rid in event.requests]
            self._seatings[0] += 1
        for job, _ in self._jobs_seated():
            job.batch_size = max(job.batch_size, len(event.requests))
            if job.joined_at is None:
                job.joined_at = now
                self.metrics.record_queue(now - job.submitted_at)
        self._gauges()

    def _jobs_seated(self) -> list[tuple[Job, dict[int, int]]]:
        """Each job of the running batch with its rows: row -> choice."""
        out: dict[int, tuple[Job, dict[int, int]]] = {}
        for b, owner in enumerate(self._seated):
            if owner is not None:
                out.setdefault(owner[0].id, (owner[0], {}))[1][b] = owner[1]
        return list(out.values())

    def _prefill(self, event: PrefillEvent) -> None:
        """The rows that joined: their prompt counts and prefix-cache hits (per choice)."""
        for job, rows in self._jobs_seated():
            joined = {c: b for b, c in rows.items() if b < len(event.prompt_tokens) and event.prompt_tokens[b]}
            if not joined:
                continue
            for c, b in joined.items():
                job.cached[c] = event.cached_tokens[b] if b < len(event.cached_tokens) else 0
            n = len(job.rows)
            prompts = tuple(event.prompt_tokens[joined[c]] if c in joined else 0 for c in range(n))
            cached = tuple(event.cached_tokens[joined[c]] if c in joined else 0 for c in range(n))
            job.stats.consume(replace(event, prompt_tokens=prompts, cached_tokens=cached))

    def _tokens(self, event: TokensEvent) -> None:
        owner = self._seated[event.row] if event.row < len(self._seated) else None
        if owner is None:
            return
        job, choice = owner
        job.stats.consume(replace(event, row=choice))
        job.ids[choice].extend(event.token_ids)
        job.text[choice] += event.text
        job.finish[choice] = event.finish_reason
        job.errors[choice] = event.error
        if event.logprobs is not None:
            job.logprobs[choice].extend(event.logprobs)
        if job.stream and not job.done:
            job.push(Chunk(choice, event.token_ids, event.text, event.finish_reason, event.logprobs, event.error))

    def _drop_cancelled(self) -> None:
        """Jobs whose client left: no more items for them (the engine stops their rows)."""
        with self._lock:
            left = [job for job in self._jobs.values() if job.cancelled and not job.done]
        for job in left:
            job.done = True
            self._forget(job)

    def _answer_finished(self) -> None:
        """Answer every seated job whose rows have all finished."""
        for job, _ in self._jobs_seated():
            if job.done or any(f is None for f in job.finish):
                continue
            job.done = True
            stats = self.job_stats(job)
            self.metrics.record_job(job.stats.counts, stats)
            choices = tuple(
                (job.text[c], tuple(job.ids[c]), job.finish[c] or FinishReason.LENGTH) for c in range(len(job.rows))
            )
            logprobs = tuple(map(tuple, job.logprobs)) if job.params.logprobs is not None else None
            job.push(Finished(choices, stats, tuple(job.cached), logprobs, tuple(job.errors)))
            self._forget(job)
        self._gauges()

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.id, None)
            for request in job.requests:
                self._owners.pop(request.id, None)

    def _fail_seated(self, exc: BaseException) -> None:
        """The engine failed: the jobs of its running batch get the error (their rows still
        waiting are dropped); the others wait on."""
        for job, _ in self._jobs_seated():
            self._fail(job, exc)
        with self._lock:
            self._seated = []
        self._gauges()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._fail(job, exc)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.done:
            return
        job.done = True
        for request in job.requests:
            self.inbox.cancel(request.id)
        job.push(Failed(exc))
        self._forget(job)

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        with self._lock:
            running = sum(1 for o in self._seated if o is not None and not o[0].done and o[0].finish[o[1]] is None)
            waiting = self.inbox.waiting()
        self.metrics.set_rows(running, waiting)

    def job_stats(self, job: Job) -> dict[str, Any]:
        """The request's own speculation stats (core.stats over its rows, every part), and
        how long it waited to join the running batch."""
        first = job.stats.first_token_at
        ttft = None if first is None else first - job.submitted_at
        graphs = self._snapshot.metrics.graphs if self._snapshot is not None else self._graphs
        m = Metrics.of(job.stats.counts, mode=self.mode, ttft_s=ttft, graphs=graphs)  # graphs: this seating's
        queue = None if job.joined_at is None else job.joined_at - job.submitted_at
        stats = m.request_stats(batch_size=job.batch_size, grammar=job.grammar is not None)
        return {**stats, "queue_s": queue, "same_every_run": self._same_every_run(job)}

    def _same_every_run(self, job: Job) -> bool:
        """Whether the job's greedy tokens are the same whatever came before or beside it
        (backends/llamacpp/alike.same_every_run: not for rows batched on llama.cpp's CPU kernels)."""
        from ssdlocal.backends.llamacpp.alike import same_every_run

        target = self.engine.config.target
        alone = len(job.rows) == 1 and job.batch_size <= 1 and not job.overlapped
        drafted = job.stats.counts.drafted > 0
        return same_every_run(target.backend, target.device, target.batch_invariant, drafted=drafted, alone=alone)
