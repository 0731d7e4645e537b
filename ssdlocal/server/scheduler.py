"""One thread owns the Engine; requests become Jobs that it batches, runs and answers.

Jobs whose settings allow it (same SamplingParams; sampled requests with a seed of their
own run alone, so a seeded sample repeats) share one `Engine.generate` call, one row
per choice; others wait in arrival order. The thread routes each row's tokens to its
job's asyncio queue, answers a job as soon as its rows finish, cancels the rows of a
job whose client left (`Engine.cancel_rows`), and survives a failed call: that batch's
jobs get the error, the next batch runs. Knows nothing of HTTP.
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

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import DoneEvent, RoundEvent, TokensEvent

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass
class RowStats:
    """One row's speculation counters, from the engine's per-row events."""

    drafted: int = 0
    accepted: int = 0
    row_rounds: int = 0
    emitted_in_rounds: int = 0  # tokens committed by decode rounds (after the first token)
    hits: int = 0
    misses: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass(frozen=True)
class Chunk:
    """New tokens of one choice; `finish_reason` set on its last chunk."""

    choice: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class Finished:
    """A job's end: per choice (text, token ids, finish reason), and its stats."""

    choices: tuple[tuple[str, tuple[int, ...], str], ...]
    stats: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(eq=False)
class Job:
    """One request: a row per choice (prompt token ids), its params, its answer queue."""

    rows: tuple[tuple[int, ...], ...]
    params: SamplingParams
    seeded: bool
    loop: asyncio.AbstractEventLoop
    stream: bool = True  # push each Chunk (else only the answer: fewer wake-ups of the loop)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the client side; the engine thread acts on it
    done: bool = False  # engine thread: answered (Finished / Failed) or dropped

    @property
    def batch_key(self) -> tuple:
        """Jobs with equal keys may share one generate call."""
        if self.params.greedy:
            return ("greedy", replace(self.params, seed=0))
        if self.seeded:
            return ("seeded", self.id)  # its own random stream: a seeded sample repeats
        return ("sampled", self.params)

    def cancel(self) -> None:
        """The client left: drop the job if it waits, stop its rows if they run."""
        self.cancelled = True

    def push(self, item: Chunk | Finished | Failed) -> None:
        """Hand an item to the job's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            self.cancelled = True


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
        self, rows: Sequence[Sequence[int]], params: SamplingParams, seeded: bool, *, stream: bool = True
    ) -> Job:
        job = Job(tuple(tuple(r) for r in rows), params, seeded, asyncio.get_running_loop(), stream)
        with self._cond:
            if self._stopping:
                job.push(Failed(RuntimeError("the server is shutting down")))
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
            job.push(Failed(RuntimeError("the server is shutting down")))
        self.engine.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self.running = len(batch)
            try:
                self._run(batch)
            finally:
                self.running = 0

    def _next_batch(self) -> list[Job] | None:
        """Wait for jobs; take the first live one and every waiting job that can share
        its generate call (up to max_batch rows), in arrival order."""
        with self._cond:
            while not self._stopping:
                self._pending = [j for j in self._pending if not j.cancelled]
                if self._pending:
                    break
                self._cond.wait()
            if self._stopping:
                return None
            # requests sent together arrive a few milliseconds apart: let them gather
            deadline = time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0 and not self._stopping:
                self._cond.wait(left)
            live = [j for j in self._pending if not j.cancelled]
            first = live[0] if live else None
            if first is None:
                self._pending = []
                return []
            batch, rows = [first], len(first.rows)
            for job in live[1:]:
                if job.batch_key == first.batch_key and rows + len(job.rows) <= self.max_batch:
                    batch.append(job)
                    rows += len(job.rows)
            self._pending = [j for j in live if j not in batch]
            return batch

    def _run(self, batch: list[Job]) -> None:
        if not batch:
            return
        params = batch[0].params
        if not params.greedy and not batch[0].seeded:
            params = replace(params, seed=random.randrange(2**31))  # a fresh sample each call
        owners = [(job, choice) for job in batch for choice in range(len(job.rows))]
        run = _BatchRun(batch, owners, self.mode)
        started = time.perf_counter()
        try:
            events = self.engine.generate([r for job in batch for r in job.rows], params)
            for event in events:
                run.cancel_left(self.engine)
                if isinstance(event, TokensEvent):
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
            for job in batch:
                if not job.done:
                    job.done = True
                    job.push(Failed(exc))


class _BatchRun:
    """The state of one generate call: which job and choice each row serves, their
    tokens, text and stats, and which jobs are answered."""

    def __init__(self, batch: list[Job], owners: list[tuple[Job, int]], mode: str) -> None:
        self.batch = batch
        self.owners = owners
        self.mode = mode
        self.stats = [RowStats() for _ in owners]
        self.text = [""] * len(owners)
        self.ids: list[list[int]] = [[] for _ in owners]
        self.finish: list[str | None] = [None] * len(owners)
        self.cancel_sent: set[int] = set()  # job ids
        self.graphs: dict | None = None  # captured-step counts of the call so far

    def cancel_left(self, engine) -> None:
        """Stop the rows of jobs whose client left (called between events)."""
        for job in self.batch:
            if job.cancelled and not job.done and job.id not in self.cancel_sent:
                self.cancel_sent.add(job.id)
                job.done = True
                engine.cancel_rows([b for b, (owner, _) in enumerate(self.owners) if owner is job])

    def tokens(self, event: TokensEvent) -> None:
        b = event.row
        now = time.perf_counter()
        stats = self.stats[b]
        if stats.first_token_at is None:
            stats.first_token_at = now
        else:
            stats.emitted_in_rounds += len(event.token_ids)
        stats.last_token_at = now
        self.ids[b].extend(event.token_ids)
        self.text[b] += event.text
        self.finish[b] = event.finish_reason
        job, choice = self.owners[b]
        if job.stream and not job.done:
            job.push(Chunk(choice, event.token_ids, event.text, event.finish_reason))

    def round(self, event: RoundEvent) -> None:
        self.graphs = event.snapshot.get("graphs", self.graphs)
        for i, b in enumerate(event.rows):
            stats = self.stats[b]
            stats.row_rounds += 1
            stats.drafted += event.n_drafted[i]
            stats.accepted += event.n_accepted[i]
            if event.cache_hit is not None:
                if event.cache_hit[i]:
                    stats.hits += 1
                else:
                    stats.misses += 1

    def answer_finished(self, metrics, everyone: bool = False) -> None:
        """Answer every job whose rows have all finished (all of them at the end)."""
        for job in self.batch:
            if job.done:
                continue
            rows = [b for b, (owner, _) in enumerate(self.owners) if owner is job]
            if not everyone and any(self.finish[b] is None for b in rows):
                continue
            job.done = True
            stats = self.job_stats(job, rows)
            metrics.record_job([self.stats[b] for b in rows], stats)
            choices = tuple((self.text[b], tuple(self.ids[b]), self.finish[b] or "length") for b in rows)
            job.push(Finished(choices, stats))

    def job_stats(self, job: Job, rows: list[int]) -> dict[str, Any]:
        """The request's own speculation stats (docs/architecture.md §3 names)."""
        rs = [self.stats[b] for b in rows]
        drafted, accepted = sum(s.drafted for s in rs), sum(s.accepted for s in rs)
        row_rounds, emitted = sum(s.row_rounds for s in rs), sum(s.emitted_in_rounds for s in rs)
        hits, misses = sum(s.hits for s in rs), sum(s.misses for s in rs)
        firsts = [s.first_token_at for s in rs if s.first_token_at is not None]
        lasts = [s.last_token_at for s in rs if s.last_token_at is not None]
        decode_s = (max(lasts) - min(firsts)) if firsts else 0.0
        return {
            "mode": self.mode,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_len": emitted / row_rounds if row_rounds else None,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
            "tokens_per_s": emitted / decode_s if decode_s > 0 else None,
            "ttft_s": (min(firsts) - job.submitted_at) if firsts else None,
            "batch_size": len(self.owners),
            "graphs": self.graphs,
        }
