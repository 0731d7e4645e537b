"""The parent's handle on one spawned child process (SSD draft worker, tensor-parallel rank).

A ChildProcess spawns its target with the `spawn` method, talks over a duplex pipe in
`(kind, payload)` messages, and enforces a deadline on every receive. Any failed or
interrupted exchange marks it `broken` (the pipe may hold half a message): it refuses
further use, and `close` kills the child at once instead of asking it to stop. Children
the program forgets to close are killed at interpreter exit. Knows no protocol beyond
the two control messages below; callers pass their own command and reply enums.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from ssdlocal.core.errors import SSDLocalError
from ssdlocal.ipc.lifetime import describe_exit

log = logging.getLogger(__name__)


class Control(IntEnum):
    """Messages every protocol shares (per-protocol enums use values >= 1)."""

    SHUTDOWN = 0  # parent -> child: exit now
    ERROR = -1  # child -> parent: ErrorReply, then the child exits non-zero


@dataclass(frozen=True)
class ErrorReply:
    """A failure in the child, as the parent will raise it."""

    message: str
    hint: str
    kind: str  # an SSDLocalError subclass name from ssdlocal.core.errors


def error_from(reply: ErrorReply, default: type[SSDLocalError]) -> SSDLocalError:
    """The exception a child's ErrorReply stands for (`default` if the kind is unknown)."""
    from ssdlocal.core import errors

    cls = getattr(errors, reply.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, SSDLocalError)):
        cls = default
    return cls(reply.message, reply.hint)


_LIVE: weakref.WeakSet[ChildProcess] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


class ChildProcess:
    """One child process and the pipe to it.

    target(conn, parent_pid, pdeathsig, *args) runs in the child (see ipc.serve).
    `error` is the exception class for failures the child did not describe itself;
    `role` names the child in messages ("the draft worker", "tensor-parallel rank 1").
    """

    def __init__(
        self,
        target: Callable,
        args: tuple,
        *,
        name: str,
        role: str,
        error: type[SSDLocalError],
        dead_hint: str,
        hung_hint: str,
    ) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.role, self.error, self.dead_hint, self.hung_hint = role, error, dead_hint, hung_hint
        self.broken = False
        self.closed = False
        _register_atexit()  # after multiprocessing's own hook, so ours runs first
        self.conn, child = ctx.Pipe(duplex=True)
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits, so only ask for it
        # from the main thread; the child also watches its parent pid itself.
        on_main = threading.current_thread() is threading.main_thread()
        self.proc = ctx.Process(target=target, args=(child, os.getpid(), on_main, *args), daemon=True, name=name)
        self.proc.start()
        _LIVE.add(self)
        child.close()

    # ------------------------------------------------------------------ messages
    def send(self, kind: IntEnum, payload=None) -> None:
        self.check_usable()
        try:
            self.conn.send((kind, payload))
        except (BrokenPipeError, OSError) as exc:
            self.broken = True
            raise self.died(f"could not reach {self.role}") from exc
        except BaseException:
            self.broken = True
            raise

    def recv(self, expect: IntEnum, timeout_s: float):
        """Wait for one reply of kind `expect`; raise on an error reply, death or timeout."""
        self.check_usable()
        try:
            return self._recv(expect, timeout_s)
        except BaseException:
            self.broken = True  # error reply, death, timeout or Ctrl-C: the pipe is spent
            raise

    def _recv(self, expect: IntEnum, limit: float):
        deadline = time.monotonic() + limit
        while True:
            if self.conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError) as exc:
                    raise self.died(f"{self.role} died") from exc
                if kind == Control.ERROR:
                    raise error_from(payload, self.error)
                if kind != expect:
                    raise self.error(
                        f"protocol error: {self.role} sent {kind!r}, expected {expect.name}",
                        "this is a bug; run with --verbose and report it",
                    )
                return payload
            if not self.proc.is_alive():
                raise self.died(f"{self.role} died")
            if time.monotonic() >= deadline:
                raise self.error(
                    f"{self.role} did not answer within {limit:g} s (it may be hung or stopped)",
                    self.hung_hint,
                )

    def pending_error(self) -> SSDLocalError | None:
        """The child's own account of a failure, if its ErrorReply is (or soon is) in the pipe."""
        try:
            while self.conn.poll(0.2 if not self.proc.is_alive() else 0):
                kind, payload = self.conn.recv()
                if kind == Control.ERROR:
                    return error_from(payload, self.error)
        except (EOFError, OSError):
            pass
        return None

    def check_usable(self) -> None:
        if self.closed or self.broken:
            raise self.error(
                f"{self.role} is " + ("closed" if self.closed else "gone after an earlier failure"),
                "create a new Engine (or rerun) to start it again",
            )

    def died(self, what: str) -> SSDLocalError:
        self.proc.join(timeout=1.0)
        return self.error(f"{what}{describe_exit(self.proc.exitcode)}", self.dead_hint)

    # ------------------------------------------------------------------ shutdown
    def close(self, grace_s: float = 2.0) -> None:
        """Stop the child; never hangs, never leaves a process. Idempotent.

        A healthy child gets SHUTDOWN and `grace_s` to exit; a broken, hung or stopped
        one (SIGTERM does not reach a SIGSTOPped process) is killed with SIGKILL.
        """
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        try:
            if not self.broken and self.proc.is_alive():
                try:
                    self.conn.send((Control.SHUTDOWN, None))
                except (BrokenPipeError, OSError):
                    pass
                self.proc.join(timeout=grace_s)
        finally:  # also after a Ctrl-C during the polite part
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5.0)
            if self.proc.is_alive():  # pragma: no cover - unkillable (D state)
                log.warning("%s (pid %s) did not exit after SIGKILL", self.role, self.proc.pid)
            self.conn.close()


def _register_atexit() -> None:
    """Kill children the program forgot to close before multiprocessing's exit hook,
    which would otherwise SIGTERM and then join a stopped child forever."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all)
        _ATEXIT_REGISTERED = True


def _close_all() -> None:
    for child in list(_LIVE):
        child.broken = True  # no polite shutdown at exit: just make sure it is gone
        child.close()
