"""Whether other work used the CPU while a run was timed (a race mode, a chat answer).

A run samples the machine before and after: the CPU time every process spent busy
(`/proc/stat`), and that of this process and its children (the SSD draft worker included:
`/proc/<pid>/stat` of each). What the machine spent beyond this process tree, over the
run's wall time, is the other load in cores; above DISTURBED_SHARE of the machine's cores
the run's timings are not this hardware's own. `os.getloadavg()` is kept beside it for
people, not used: its one-minute average trails a run of seconds and counts this run's
own threads. Where `/proc` is missing (not Linux), or a run took under MIN_WALL_S, the
other load is unknown (None).
UI-free: no Textual import.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DISTURBED_SHARE = 0.15  # others' share of the machine's cores above which a run is disturbed
MIN_WALL_S = 1.0  # shorter runs: the counters' 10 ms ticks make the share meaningless (unknown)
_PROC = Path("/proc")


@dataclass(frozen=True)
class LoadSample:
    """One reading: wall clock, the machine's busy CPU seconds (None without /proc), this
    process tree's CPU seconds, and the number of cores."""

    wall: float
    busy: float | None
    ours: float
    cores: int


@dataclass(frozen=True)
class Disturbance:
    """Other processes' CPU during a run: `others_cores` on average (None: unknown)."""

    others_cores: float | None
    cores: int
    wall_s: float

    @property
    def disturbed(self) -> bool:
        return self.others_cores is not None and self.others_cores > DISTURBED_SHARE * self.cores

    def describe(self) -> str:
        """`other processes used 0.9 of 2 cores` (or `other load unknown`)."""
        if self.others_cores is None:
            return "other load unknown (no /proc, or a run under a second)"
        return f"other processes used {self.others_cores:.1f} of {self.cores} cores"

    def short(self) -> str:
        """For a 20-column cell: `others 0.9/2 cores`."""
        if self.others_cores is None:
            return "unknown"
        return f"others {self.others_cores:.1f}/{self.cores} cores"


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _busy_seconds() -> float | None:
    """Seconds all cores spent busy since boot (idle and iowait left out)."""
    try:
        fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(values) - values[3] - values[4]) / _ticks()


def _stat(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ...


def _tree_seconds(root: int) -> float:
    """CPU seconds of `root` and its live descendants (utime + stime, and what waited
    children spent: cutime + cstime)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is None or len(fields) < 15:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(float(f) for f in fields[11:15])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree) / _ticks()


def sample() -> LoadSample:
    cores = os.cpu_count() or 1
    if not _PROC.is_dir():
        cpu = os.times()
        return LoadSample(time.monotonic(), None, cpu.user + cpu.system, cores)
    return LoadSample(time.monotonic(), _busy_seconds(), _tree_seconds(os.getpid()), cores)


def between(before: LoadSample, after: LoadSample) -> Disturbance:
    """The other load between two samples (never below zero: the counters tick in steps)."""
    wall = max(after.wall - before.wall, 1e-9)
    if before.busy is None or after.busy is None or wall < MIN_WALL_S:
        return Disturbance(None, after.cores, wall)
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return Disturbance(max(others, 0.0) / wall, after.cores, wall)


Meter = Callable[[], LoadSample]  # what a timed run samples the machine with (tests: a fake)
