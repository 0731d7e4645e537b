"""Child processes in tests: finding them in /proc, waiting for them to go, and
interrupting a CLI while it streams (Linux only: uses /proc and signals).

`interrupt_while_streaming` freezes the CLI (SIGSTOP) as soon as it has printed, queues the
SIGINT while it is frozen and only then lets it run again: the answer cannot end between
"streaming has started" and the signal, however busy the machine is.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import pytest


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs: absent, or a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids, timeout_s: float) -> list[int]:
    """Wait until every pid is gone; return the ones still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if not process_gone(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("PPid:"):
                        if int(line.split()[1]) == pid:
                            found.append(int(entry))
                        break
        except OSError:
            continue
    return found


def read_until_output(proc: subprocess.Popen, timeout_s: float) -> bytes:
    """The first bytes `proc` writes to its stdout (a pipe); fails the test if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            return os.read(proc.stdout.fileno(), 4096)
        if proc.poll() is not None:
            break
    pytest.fail(f"no output (rc={proc.poll()}): {proc.stderr.read().decode() if proc.poll() is not None else ''}")


def interrupt_while_streaming(proc: subprocess.Popen, timeout_s: float = 90) -> list[int]:
    """Wait for `proc`'s first output, then deliver Ctrl-C while it cannot finish on its own.

    The process is stopped the moment it has printed, its children are listed while it is
    stopped, SIGINT is queued, and SIGCONT resumes it: the interrupt is handled at its next
    step, before the answer can end. Returns the children seen while it was stopped."""
    read_until_output(proc, timeout_s)  # streaming has started
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        children = children_of(proc.pid)
        os.kill(proc.pid, signal.SIGINT)  # pending until the process runs again
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return children
