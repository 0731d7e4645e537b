"""Lifetime helpers for ssdlocal's child processes (the SSD draft worker, TP ranks).

A child must never outlive its parent and must describe how it died. Standard library
only; used by the ipc client (parent side) and serve loop (child side).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:  # pragma: no cover - exotic libc
        pass


def watch_parent(parent_pid: int, every_s: float = 0.5) -> None:
    """Exit as soon as the parent is gone (reparented), even in the middle of a long
    model load or forward; covers platforms and threads without PDEATHSIG."""

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="ssdlocal-parent-watch", daemon=True).start()


def start_child(parent_pid: int, pdeathsig: bool) -> None:
    """What every child does first: tie its life to the parent, leave SIGINT to it.

    `pdeathsig` is False when the parent spawned us from a non-main thread: Linux
    delivers PDEATHSIG when that *thread* exits, which would kill a healthy child.
    """
    if pdeathsig:
        die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
        os._exit(0)
    watch_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop


def describe_exit(code: int | None) -> str:
    """' (exit code N)' / ' (killed by signal SIGKILL)' for a process exit code; '' if alive."""
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by signal {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" (exit code {code})"
