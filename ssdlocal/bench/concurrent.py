"""The concurrent-clients workload: N clients (agents with tools, editor FIM completions,
streaming chats; bench/clients.py) at once against one server after another, each server
a child process (bench/servers.py) started, warmed with one untimed request, measured and
stopped before the next, so they never share the CPU.

Each client sends its next request as soon as its previous answer has ended, until it has
sent `requests` or `duration_s` has passed since the clients started. Every request is
timed on the client (bench/stream.py); `summarize` turns the timings into percentiles
and rates; report_concurrent.py writes them. Nothing here prints: progress goes to an
optional callback `progress(stage, done, total, label)`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssdlocal.bench.clients import KINDS, make_clients
from ssdlocal.bench.servers import ServerProcess, ServerSpec, llamacpp_server, peer_unavailable, ssdlocal_server
from ssdlocal.bench.stream import RequestTiming, timed_request
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.errors import SSDLocalError, UsageError

ProgressFn = Callable[[str, int, int, str], None]
SERVED_NAME = "bench"  # the model id every server is started with and every client sends
SERVER_MODES = ("ar", "sd", "ssd", "auto")  # --modes: one `ssdlocal serve --mode M` each
SERVER_PEERS = ("llamacpp",)  # --peers: llama-cpp-python's own server on the GGUF target
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ConcurrentSettings:
    """What the concurrent workload runs: our servers (one per mode, started with
    `serve_args`), the peers, the clients and how long they go on."""

    modes: tuple[str, ...] = ("auto",)
    peers: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()  # the model / speculation flags for `ssdlocal serve`
    clients: int = 3
    requests: int = 3  # per client
    duration_s: float | None = None  # stop starting requests after this many seconds
    peer_python: str = sys.executable
    gguf_target: str | None = None
    threads: int = field(
        default_factory=lambda: (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
    )  # the peer's; ours sizes its own
    n_ctx: int = 4096  # the peer's context (llama-cpp-python's default is 2048)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in SERVER_MODES]
        if bad or len(set(self.modes)) != len(self.modes):
            raise UsageError(
                f"bad --modes {','.join(self.modes)!r} for the concurrent workload",
                f"a comma list of distinct {', '.join(SERVER_MODES)} (one server each)",
            )
        bad = [p for p in self.peers if p not in SERVER_PEERS]
        if bad:
            raise UsageError(
                f"peer {bad[0]!r} has no server to run in the concurrent workload",
                f"use --peers {','.join(SERVER_PEERS)} (llama-cpp-python's server) or none",
            )
        if not self.modes and not self.peers:
            raise UsageError("nothing to run", "pass --modes auto and/or --peers llamacpp")
        for name, value in (("clients", self.clients), ("requests", self.requests)):
            if value < 1:
                raise UsageError(f"--{name} must be >= 1, got {value}", f"use e.g. --{name} 3")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise UsageError(
                f"--duration must be a positive number of seconds, got {self.duration_s}",
                "use e.g. --duration 120, or leave it out to run every --requests",
            )


@dataclass
class ConcurrentRun:
    """The workload's measurements: per server its request timings, plus what was skipped
    and the servers' process ids (all stopped when run_concurrent returns)."""

    settings: ConcurrentSettings
    params: SamplingParams
    timings: dict[str, list[RequestTiming]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def server_specs(settings: ConcurrentSettings) -> tuple[list[ServerSpec], dict[str, str]]:
    """The servers to start, in order, and {name: why} for peers that cannot run here."""
    specs = [ssdlocal_server(f"ssdlocal-{m}", (*settings.serve_args, "--mode", m), SERVED_NAME) for m in settings.modes]
    skipped = {}
    for peer in settings.peers:
        name = f"{peer}-server"
        why = peer_unavailable(settings.peer_python, settings.gguf_target)
        if why:
            skipped[name] = why
            continue
        specs.append(
            llamacpp_server(
                name, settings.peer_python, settings.gguf_target, SERVED_NAME, settings.threads, settings.n_ctx
            )
        )
    return specs, skipped


def run_concurrent(
    settings: ConcurrentSettings, params: SamplingParams, out_dir: Path, progress: ProgressFn | None = None
) -> ConcurrentRun:
    """Start each server, warm it, run the clients against it, stop it; server logs go to
    out_dir/server-<name>.log. A server that fails to start raises SSDLocalError (after
    stopping it); Ctrl-C stops the running server too."""
    progress = progress or (lambda *a: None)
    wall = time.perf_counter()
    specs, skipped = server_specs(settings)
    run = ConcurrentRun(settings, params, skipped=skipped)
    for spec in specs:
        progress("start", 0, 0, spec.name)
        with ServerProcess(spec, out_dir / f"server-{spec.name}.log") as server:
            run.pids[spec.name] = server.pid
            _warm_up(server, params)
            run.timings[spec.name] = run_clients(
                server.host,
                server.port,
                settings,
                params,
                lambda done, total: progress("clients", done, total, spec.name),
            )
    run.wall_s = time.perf_counter() - wall
    return run


def _warm_up(server: ServerProcess, params: SamplingParams) -> None:
    """One short untimed completion: first-call costs (graphs, caches) stay out of the timings."""
    body = {
        "model": SERVED_NAME,
        "prompt": "def hello():",
        "max_tokens": WARMUP_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    timing, _ = timed_request(
        server.host, server.port, "/v1/completions", body, client=-1, kind="warmup", t0=time.perf_counter()
    )
    if timing.error:
        raise SSDLocalError(
            f"{server.spec.name} failed its warm-up request: {timing.error}", f"its log: {server.log_path}"
        )


def run_clients(
    host: str,
    port: int,
    settings: ConcurrentSettings,
    params: SamplingParams,
    progress: Callable[[int, int], None] | None = None,
) -> list[RequestTiming]:
    """All clients at once against host:port; every request's timing, in the order they ended."""
    clients = make_clients(settings.clients, params, SERVED_NAME)
    total = settings.clients * settings.requests
    timings: list[RequestTiming] = []
    lock = threading.Lock()
    start = threading.Barrier(len(clients) + 1)
    t0_box: list[float] = []

    def drive(index: int, client) -> None:
        start.wait()
        t0 = t0_box[0]
        for _ in range(settings.requests):
            if settings.duration_s is not None and time.perf_counter() - t0 > settings.duration_s:
                break
            path, body = client.request()
            timing, reply = timed_request(host, port, path, body, client=index, kind=client.kind, t0=t0)
            client.observe(reply)
            with lock:
                timings.append(timing)
                if progress:
                    progress(len(timings), total)

    threads = [
        threading.Thread(target=drive, args=(i, c), daemon=True, name=f"bench-client-{i}")
        for i, c in enumerate(clients)
    ]
    for t in threads:
        t.start()
    t0_box.append(time.perf_counter())
    start.wait()
    for t in threads:
        while t.is_alive():  # short waits: Ctrl-C reaches this (main) thread at once
            t.join(0.2)
    return timings


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timings: Sequence[RequestTiming]) -> dict:
    """Percentiles and rates over requests. Rates divide by the span from the first request's
    start to the last one's end; failed requests count in `errors` only."""
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    total = [t.total_s for t in ok]
    queue = [t.queue_s for t in ok if t.queue_s is not None]
    span = max((t.start_s + t.total_s for t in ok), default=0.0) - min((t.start_s for t in ok), default=0.0)
    tokens = sum(t.completion_tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "total_p50_s": percentile(total, 50),
        "total_p95_s": percentile(total, 95),
        "queue_p50_s": percentile(queue, 50),
        "queue_p95_s": percentile(queue, 95),
        "completion_tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span > 0 else None,
        "requests_per_s": len(ok) / span if span > 0 else None,
        "tokens_from": sorted({t.tokens_from for t in ok}),
        "tool_calls": sum(t.tool_calls for t in ok),
    }


def summaries(run: ConcurrentRun) -> tuple[dict, dict]:
    """({system: summary}, {system: {kind: summary}}) over the run's timings."""
    whole = {name: summarize(ts) for name, ts in run.timings.items()}
    by_kind = {
        name: {k: summarize([t for t in ts if t.kind == k]) for k in KINDS if any(t.kind == k for t in ts)}
        for name, ts in run.timings.items()
    }
    return whole, by_kind
