"""One thread owns the Engine; requests become Jobs that it batches, runs and answers.

A job's rows (one per choice) run in parts: consecutive rows with the same token budget,
at most `max_batch` of them, so no engine call ever has more than `max_batch` rows.
Parts whose settings allow it (same SamplingParams; sampled requests with a seed of
their own run alone, so a seeded sample repeats) share one `Engine.generate` call;
others wait in arrival order. The thread routes each row's tokens to its job's asyncio
queue, answers a job as soon as all its rows finish, cancels the rows of a job whose
client left (`Engine.cancel_rows`), and survives a failed call: that batch's jobs get
the error, the next batch runs. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ssdlocal.backends import registry
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams, repeatable
from ssdlocal.core.events import DoneEvent, PrefillEvent, RoundEvent, TokensEvent
from ssdlocal.core.metrics import Metrics, add_counts, new_counts
from ssdlocal.core.stats import RunStats

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass(frozen=True)
class Chunk:
    """New tokens of one choice; `finish_reason` set on its last chunk."""

    choice: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    logprobs: tuple | None = None  # core.events.TokenLogprob per token, when asked for
    error: str | None = None  # with finish_reason "error": why the choice could not go on


@dataclass(frozen=True)
class Finished:
    """A job's end: per choice (text, token ids, finish reason), and its stats."""

    choices: tuple[tuple[str, tuple[int, ...], str], ...]
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


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of a job that run in one engine call, with these params."""

    start: int
    stop: int
    params: SamplingParams


@dataclass(eq=False)
class Job:
    """One request: a row per choice (prompt token ids), its params, its answer queue.
    The engine thread keeps each choice's tokens, text and stats here across parts."""

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
        self.parts: list[Part] = []  # split by the scheduler
        self.next_part = 0  # parts before it have run or are running
        self.counts: dict[str, Any] = new_counts(0)  # core.stats counts of its parts so far
        self.first_token_at: float | None = None
        self.text = [""] * n
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.errors: list[str | None] = [None] * n  # per choice: its grammar's failure
        self.cached = [0] * n  # per choice: prompt tokens the prefix cache held
        self.batch_size = 0  # rows of the largest engine call it shared

    def split(self, max_batch: int) -> None:
        """Parts of at most max_batch consecutive rows with one budget each. A seeded
        sampled job's later parts draw from seeds of their own (rows must not repeat)."""
        budgets = self.budgets or (self.params.max_new_tokens,) * len(self.rows)
        start = 0
        while start < len(self.rows):
            stop = start + 1
            while stop < len(self.rows) and stop - start < max_batch and budgets[stop] == budgets[start]:
                stop += 1
            params = replace(self.params, max_new_tokens=budgets[start])
            if start and self.seeded and not params.greedy:
                params = replace(params, seed=params.stream_seed(start * _PART_SEED_STRIDE))
            self.parts.append(Part(start, stop, params))
            start = stop

    def batch_key(self, part: Part) -> tuple:
        """Parts with equal keys may share one generate call."""
        if part.params.greedy:
            return ("greedy", replace(part.params, seed=0))
        if self.seeded:
            return ("seeded", self.id, part.start)  # its own random stream: a seeded sample repeats
        return ("sampled", part.params)

    def cancel(self) -> None:
        """The client left: drop the job if it waits, stop its rows if they run."""
        self.cancelled = True

    def push(self, item: Chunk | Finished | Failed) -> None:
        """Hand an item to the job's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            self.cancelled = True


_PART_SEED_STRIDE = 0x9E3779B1  # seeds of a job's later parts: far from the drafter's offsets


class Scheduler:
    """Runs jobs on one engine in a thread of its own; `submit` from any thread."""

    def __init__(self, engine, metrics, *, mode: str, max_batch: int = 8, batch_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.metrics = metrics
        self.mode = mode
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.running = 0  # jobs in the running batch
        self._thread = threading.Thread(target=self._loop, name="ssdlocal-engine", daemon=True)

    # ------------------------------------------------------------------ client side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._pending)

    def submit(
        self, rows: Sequence[Sequence[int]], params: SamplingParams, seeded: bool, *, stream: bool = True,
        budgets: Sequence[int | None] | None = None, grammar=None,
    ) -> Job:
        """A job for these rows; `budgets`: each row's max_new_tokens (None: the room left
        in the context), instead of params.max_new_tokens for all; `grammar`: what every
        row's answer must follow (rows of other jobs in the same call are not affected)."""
        job = Job(tuple(tuple(r) for r in rows), params, seeded, asyncio.get_running_loop(), stream,
                  tuple(budgets) if budgets is not None else None, grammar)  # fmt: skip
        job.split(self.max_batch)
        with self._cond:
            if self._stopping:
                job.push(Failed(ServerShuttingDown()))
                return job
            self._pending.append(job)
            self._cond.notify()
        return job

    def stop(self, timeout: float = 10.0) -> None:
        """Fail waiting jobs, cancel the running batch, and join the thread."""
        with self._cond:
            self._stopping = True
            waiting, self._pending = self._pending, []
            self._cond.notify_all()
        for job in waiting:
            if not job.done:
                job.push(Failed(ServerShuttingDown()))
        self.engine.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        # CUDA's current device is per thread: the engine runs here, not where it was made
        registry.claim_device(self.engine.config.target.device)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self.running = len(batch)
            try:
                self._run(batch)
            finally:
                self.running = 0

    def _next_batch(self) -> list[tuple[Job, Part]] | None:
        """Wait for jobs; take the first live job's next part and the next part of every
        waiting job that can share its generate call (up to max_batch rows), in arrival
        order. A job stays in line until all its parts are taken."""
        with self._cond:
            while not self._stopping:
                self._pending = [j for j in self._pending if not (j.cancelled or j.done)]
                if self._pending:
                    break
                self._cond.wait()
            if self._stopping:
                return None
            # requests sent together arrive a few milliseconds apart: let them gather
            deadline = time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0 and not self._stopping:
                self._cond.wait(left)
            live = [j for j in self._pending if not (j.cancelled or j.done)]
            if not live:
                self._pending = []
                return []
            first = live[0]
            part = first.parts[first.next_part]
            key, batch, rows = first.batch_key(part), [(first, part)], part.stop - part.start
            for job in live[1:]:
                other = job.parts[job.next_part]
                if job.batch_key(other) == key and rows + other.stop - other.start <= self.max_batch:
                    batch.append((job, other))
                    rows += other.stop - other.start
            for job, _ in batch:
                job.next_part += 1
            self._pending = [j for j in live if j.next_part < len(j.parts)]
            return batch

    def _run(self, batch: list[tuple[Job, Part]]) -> None:
        if not batch:
            return
        first, part = batch[0]
        params = part.params
        if not params.greedy and not first.seeded:
            params = replace(params, seed=random.randrange(2**31))  # a fresh sample each call
        owners = [(job, choice) for job, p in batch for choice in range(p.start, p.stop)]
        for job, _ in batch:
            job.batch_size = max(job.batch_size, len(owners))
        run = _BatchRun(batch, owners, self.mode)
        started = time.perf_counter()
        try:
            # a seeded sample repeats: its proposals may not depend on timing or on earlier requests
            spec = repeatable(self.engine.config.spec) if first.seeded and not params.greedy else None
            stop = CancelToken()  # the whole call, while its prompts are read, once every job left
            grammars = [job.grammar for job, _ in owners]
            events = self.engine.generate([job.rows[choice] for job, choice in owners], params, spec=spec,
                                          cancel=stop, progress=lambda _: run.stop_if_all_left(stop),
                                          grammars=grammars if any(g is not None for g in grammars) else None)
            for event in events:
                run.cancel_left(self.engine)
                if isinstance(event, PrefillEvent):
                    run.prefill(event)
                elif isinstance(event, TokensEvent):
                    self.metrics.record_tokens(len(event.token_ids))
                    run.tokens(event)
                elif isinstance(event, RoundEvent):
                    run.round(event)
                    run.answer_finished(self.metrics)
                elif isinstance(event, DoneEvent):
                    run.graphs = event.stats.get("graphs", run.graphs)
                    run.answer_finished(self.metrics, everyone=True)
                    self.metrics.record_batch(event.stats, time.perf_counter() - started)
        except Exception as exc:  # one failed call must not stop the server
            log.warning("generate failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
            for job, _ in batch:
                if not job.done:
                    job.done = True
                    job.push(Failed(exc))


class _BatchRun:
    """One generate call: which job and choice each row serves (`owners`), which parts
    it runs, and which of their jobs are answered. Rows' tokens and stats go to the job."""

    def __init__(self, batch: list[tuple[Job, Part]], owners: list[tuple[Job, int]], mode: str) -> None:
        self.batch = batch
        self.owners = owners
        self.mode = mode
        self.cancel_sent: set[int] = set()  # job ids
        self.graphs: dict | None = None  # captured-step counts of the call so far
        self.complete: set[int] = set()  # job ids whose part in this call has finished
        self.stats = {  # per job: core.stats over its rows of this call
            job.id: RunStats(rows=frozenset(b for b, (owner, _) in enumerate(owners) if owner is job))
            for job, _ in batch
        }  # fmt: skip

    def cancel_left(self, engine) -> None:
        """Stop the rows of jobs whose client left (called between events)."""
        for job, _ in self.batch:
            if job.cancelled and not job.done and job.id not in self.cancel_sent:
                self.cancel_sent.add(job.id)
                job.done = True
                engine.cancel_rows([b for b, (owner, _) in enumerate(self.owners) if owner is job])

    def stop_if_all_left(self, token: CancelToken) -> None:
        """While long prompts are read (the engine's thread): stop the call when no job in
        it has a client left (a row's own cancel only takes effect between rounds)."""
        if all(job.cancelled for job, _ in self.batch):
            token.cancel()

    def prefill(self, event: PrefillEvent) -> None:
        for b, (job, choice) in enumerate(self.owners):
            job.cached[choice] = event.cached_tokens[b] if b < len(event.cached_tokens) else 0
        for stats in self.stats.values():
            stats.consume(event)

    def tokens(self, event: TokensEvent) -> None:
        job, choice = self.owners[event.row]
        self.stats[job.id].consume(event)
        job.ids[choice].extend(event.token_ids)
        job.text[choice] += event.text
        job.finish[choice] = event.finish_reason
        job.errors[choice] = event.error
        if event.logprobs is not None:
            job.logprobs[choice].extend(event.logprobs)
        if job.stream and not job.done:
            job.push(Chunk(choice, event.token_ids, event.text, event.finish_reason, event.logprobs, event.error))

    def round(self, event: RoundEvent) -> None:
        self.graphs = event.snapshot.get("graphs", self.graphs)
        for stats in self.stats.values():
            stats.consume(event)

    def answer_finished(self, metrics, everyone: bool = False) -> None:
        """Answer every job whose rows have all finished (all parts run: at the end of
        the call, every part of it has)."""
        for job, part in self.batch:
            if job.done or job.id in self.complete:
                continue
            rows = range(part.start, part.stop)
            if not everyone and any(job.finish[c] is None for c in rows):
                continue
            self.complete.add(job.id)
            part_stats = self.stats[job.id]
            add_counts(job.counts, part_stats.counts)
            if job.first_token_at is None:
                job.first_token_at = part_stats.first_token_at
            for c in rows:
                job.finish[c] = job.finish[c] or "length"
            if part is not job.parts[-1]:
                continue  # its next part answers it
            job.done = True
            stats = self.job_stats(job)
            metrics.record_job(job.counts, stats)
            choices = tuple((job.text[c], tuple(job.ids[c]), job.finish[c] or "length") for c in range(len(job.rows)))
            logprobs = tuple(map(tuple, job.logprobs)) if job.params.logprobs is not None else None
            job.push(Finished(choices, stats, tuple(job.cached), logprobs, tuple(job.errors)))

    def job_stats(self, job: Job) -> dict[str, Any]:
        """The request's own speculation stats (core.stats over its rows, every part)."""
        ttft = None if job.first_token_at is None else job.first_token_at - job.submitted_at
        m = Metrics.of(job.counts, mode=self.mode, ttft_s=ttft, graphs=self.graphs)  # graphs: the finishing call's
        return m.request_stats(batch_size=job.batch_size, grammar=job.grammar is not None)
