"""The child's side: the process entry wrapper and the loop that answers the parent.

`run_child` ties the child's life to its parent, runs its body, and turns any failure
into one ErrorReply before exiting non-zero. `serve` answers commands until SHUTDOWN,
the pipe closing, or the parent dying; it returns which of these ended it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from ssdlocal.core.errors import SSDLocalError
from ssdlocal.core.memory import oom_error
from ssdlocal.ipc.child import Control, ErrorReply
from ssdlocal.ipc.lifetime import start_child


def run_child(
    conn,
    parent_pid: int,
    pdeathsig: bool,
    body: Callable[[], object],
    *,
    role: str,
    default_kind: str,
    prefix_errors: bool = False,
) -> None:
    """Run `body()` as a child process; never returns normally.

    Exit code 0 after a clean end (or when the parent went away), 1 after reporting an
    error (its message prefixed with `role` when `prefix_errors`). `os._exit` skips
    interpreter teardown, where gloo/NCCL store threads may abort.
    """
    start_child(parent_pid, pdeathsig)
    code = 0
    try:
        body()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - report anything else, then exit non-zero
        send_error(conn, exc, role, default_kind, prefix=prefix_errors)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def send_error(conn, exc: BaseException, role: str, default_kind: str, *, prefix: bool = False) -> None:
    """Report `exc` to the parent as an ErrorReply (best effort: the pipe may be gone)."""
    exc = oom_error(exc, "" if prefix else f"in the {role}") or exc  # the allocator's error: a clear message
    if isinstance(exc, SSDLocalError):
        message = f"{role}: {exc.message}" if prefix else exc.message
        reply = ErrorReply(message, exc.hint, type(exc).__name__)
    else:
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        reply = ErrorReply(
            f"{role} crashed: {tail}",
            "run with --verbose; out of memory or a device error is the usual cause, otherwise report the bug",
            default_kind,
        )
    try:
        conn.send((Control.ERROR, reply))
    except (OSError, EOFError):
        pass


def serve(conn, parent_pid: int, handle: Callable[[object, object], None]) -> str:
    """Call `handle(kind, payload)` for each message; returns "shutdown" or "orphaned".

    Waits in one-second polls so a parent that died without closing the pipe is noticed.
    """
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return "orphaned"
            continue
        kind, payload = conn.recv()
        if kind == Control.SHUTDOWN:
            return "shutdown"
        handle(kind, payload)
