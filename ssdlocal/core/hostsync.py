"""The device audit: every host wait of the hot paths goes through here, counted per model.

On a GPU each device -> host read (`.tolist()`, `.item()`, `bool(t)`, `int(t)`, `nonzero`,
`.cpu()`) and each blocking host -> device copy synchronises the stream: the device drains,
then idles while Python builds its next input. The engine's round, the drafters, the
grammar guides and the SSD worker make those moves only through a `Site` (an `Audit` and a
model name: "target", "draft", "worker"), so the waits are counted where they happen and
reported per round (core/stats.py, the server's /metrics); an architecture test keeps raw
reads out of the hot paths. Uploads (`Site.upload`) go through pinned staging with
`non_blocking=True` on CUDA: torch's caching host allocator records an event on the pinned
block at the copy and hands the block out again only once that event has completed, so a
staging buffer is never overwritten while its copy is in flight, and the host never waits.
A model's reads can be bounded (`Audit.bound`): on CUDA the read first polls an event of
the device's stream with a deadline instead of blocking in the driver, so a device that
never finishes (a tensor-parallel rank hung inside a captured all-reduce) becomes an error
instead of a process stuck for ever. Knows no model, no round; torch is imported at first
use, not at import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostWaits:
    """One model's counts: `reads` (device -> host), `blocking` (host -> device copies that
    wait) and `staged` (host -> device copies through pinned staging: no wait)."""

    reads: int = 0
    blocking: int = 0
    staged: int = 0

    @property
    def waits(self) -> int:
        """Stream synchronisations on a GPU: reads + blocking copies."""
        return self.reads + self.blocking

    def __add__(self, other: HostWaits) -> HostWaits:
        return HostWaits(self.reads + other.reads, self.blocking + other.blocking, self.staged + other.staged)

    def __sub__(self, other: HostWaits) -> HostWaits:
        return HostWaits(self.reads - other.reads, self.blocking - other.blocking, self.staged - other.staged)

    def as_dict(self, rounds: int | None = None) -> dict[str, Any]:
        """JSON form; with `rounds`, also `waits_per_round` (None when no round ran)."""
        out: dict[str, Any] = {
            "waits": self.waits,
            "reads": self.reads,
            "blocking": self.blocking,
            "staged": self.staged,
        }
        if rounds is not None:
            out["waits_per_round"] = self.waits / rounds if rounds else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostWaits:
        return cls(int(d.get("reads", 0)), int(d.get("blocking", 0)), int(d.get("staged", 0)))


SPIN_S = 0.002  # a bounded read polls without sleeping this long, then sleeps between polls
POLL_S = 0.0005


@dataclass(frozen=True)
class Bound:
    """How long one model's device work may take before a read gives up: past `limit_s`,
    `late(limit_s)` gives the exception raised."""

    limit_s: float
    late: Callable[[float], BaseException]

    def wait(self, device) -> None:
        """Until the work queued on `device`'s current stream so far has finished, or raise."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        start = time.monotonic()
        while not event.query():
            waited = time.monotonic() - start
            if waited > self.limit_s:
                raise self.late(self.limit_s)
            time.sleep(0 if waited < SPIN_S else POLL_S)  # sleep(0) lets other threads run


class Audit:
    """Running counts per model for one engine (or one worker process); thread-safe."""

    def __init__(self) -> None:
        self._counts: dict[str, HostWaits] = {}
        self._lock = threading.Lock()
        self.bounds: dict[str, Bound] = {}  # per model: reads on CUDA wait at most this long

    def bound(self, model: str, limit_s: float, late: Callable[[float], BaseException]) -> None:
        """`model`'s reads of CUDA tensors give up after `limit_s` (raising `late(limit_s)`)."""
        self.bounds[model] = Bound(limit_s, late)

    def site(self, model: str) -> Site:
        return Site(self, model)

    def watch(self, runner, model: str):
        """Count a runner's own host -> device inputs as `model`'s (runners that make none,
        such as llama.cpp's, have no `count_host_waits`); returns the runner."""
        if hasattr(runner, "count_host_waits"):
            runner.count_host_waits(self.site(model))
        return runner

    def add(self, model: str, reads: int = 0, blocking: int = 0, staged: int = 0) -> None:
        with self._lock:
            self._counts[model] = self._counts.get(model, HostWaits()) + HostWaits(reads, blocking, staged)

    def merge(self, model: str, more: HostWaits) -> None:
        """Counts made elsewhere (another process) for `model`."""
        self.add(model, more.reads, more.blocking, more.staged)

    def snapshot(self) -> dict[str, HostWaits]:
        with self._lock:
            return dict(self._counts)

    def since(self, before: dict[str, HostWaits]) -> dict[str, HostWaits]:
        """Counts made after `before` (a snapshot), per model that made any."""
        now = self.snapshot()
        return {m: w - before.get(m, HostWaits()) for m, w in now.items() if w != before.get(m, HostWaits())}


class WaitsSince:
    """Calling it: the counts per model made in `audit` since it was built, plus `worker()`'s
    (a HostWaits counted in another process, or None) as "worker"; `freeze` keeps them."""

    def __init__(self, audit: Audit, worker=None) -> None:
        self.audit, self.worker = audit, worker
        self.before = audit.snapshot()
        self.frozen: dict[str, HostWaits] | None = None

    def __call__(self) -> dict[str, HostWaits]:
        if self.frozen is not None:
            return self.frozen
        waits = self.audit.since(self.before)
        more = self.worker() if self.worker is not None else None
        return waits if more is None else {**waits, "worker": more}

    def freeze(self) -> None:
        self.frozen = self()


class Site:
    """Where one model's tensors cross between host and device; each crossing is counted.

    `read` is the only way a hot path turns device tensors into Python values; `upload` and
    `to_device` the only ways it sends host data to a device."""

    def __init__(self, audit: Audit, model: str) -> None:
        self.audit = audit
        self.model = model

    def read(self, *tensors) -> Any:
        """Python lists (or scalars) of `tensors`: one wait for all of them (they are read one
        after another; the first read drains the stream, the others find it drained)."""
        self.audit.add(self.model, reads=1)
        bound = self.audit.bounds.get(self.model)
        if bound is not None and tensors and getattr(tensors[0], "is_cuda", False):
            bound.wait(tensors[0].device)  # the same one wait, with a deadline
        values = [t.tolist() for t in tensors]
        return values[0] if len(values) == 1 else values

    def waited(self) -> None:
        """Count a synchronisation made on purpose elsewhere (a stream drained before a
        message that is the only synchronisation, a poll that must see finished work)."""
        self.audit.add(self.model, reads=1)

    def upload(self, data: Sequence | Any, device, dtype=None) -> Any:
        """Host data (nested lists of numbers, or a host tensor) as a tensor on `device`,
        without a host wait where the device allows it (see the module docstring)."""
        import torch

        host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype or torch.long)
        return self.to_device(host, device)

    def to_device(self, host, device) -> Any:
        """A host tensor on `device`: pinned staging + non_blocking on CUDA (counted as
        staged), the tensor itself on the CPU (staged: nothing to wait for), a blocking copy
        elsewhere (counted as a wait)."""
        import torch

        device = torch.device(device)
        if device.type == "cpu":
            self.audit.add(self.model, staged=1)
            return host
        if device.type == "cuda":
            self.audit.add(self.model, staged=1)
            pinned = host.pin_memory() if torch.cuda.is_available() else host  # (CUDA-shaped fakes cannot pin)
            return pinned.to(device, non_blocking=True)
        self.audit.add(self.model, blocking=1)
        return host.to(device)


def detached_site(model: str) -> Site:
    """A Site counting into an audit nobody reads (parts built without an engine: tests)."""
    return Audit().site(model)
