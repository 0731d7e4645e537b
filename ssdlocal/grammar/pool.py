"""Grammar compiles bounded as a resource: a few child processes that can be killed.

llguidance cannot be interrupted once a compile runs, and a thread left running past the
time limit keeps its CPU and memory. `CompilePool` first compiles each new grammar in a
child process (`workers` of them, kept warm with the vocabulary view built): one that
does not finish within the limit is killed, so a refused compile stops using CPU and
memory at once, and a fresh child replaces it. Only a grammar that compiled there in time
is compiled again in the server's process (the same work, so bounded by the same limit).
At most `workers` compiles run at a time; at most `queue` more wait for one (bounded by
the same time limit), and the rest are refused at once (reason "busy"). Knows nothing of
HTTP.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from contextlib import contextmanager

from ssdlocal.grammar.compiler import GrammarError

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a child's start-up (imports and the vocabulary view): not a grammar's fault


class CompilePool:
    """Child processes that check that grammars compile in time (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, *, workers: int = 1, queue: int = 8, serve=None) -> None:
        """`serve`: the children's main function (default: compile with llguidance), a
        module-level function taking (connection, tokenizer, vocab_size, eos_ids)."""
        self._args = (serve or _serve, tokenizer, vocab_size, sorted(eos_ids))
        self.workers = workers
        self.queue = queue
        self._ctx = multiprocessing.get_context("spawn")  # no copy of the server's threads or model
        self._slots = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._waiting = 0
        self.killed = 0  # children killed past the time limit
        self._closed = False

    def start(self) -> None:
        """Start the children now (else on the first compile)."""
        with self._lock:
            while len(self._idle) < self.workers:
                self._idle.append(_Child(self._ctx, self._args))

    @contextmanager
    def slot(self, timeout_s: float):
        """Hold one of the `workers` compile slots (the caller's compile runs under it):
        GrammarError "busy" when `queue` callers already wait, or no slot frees in time."""
        with self._lock:
            if self._waiting >= self.queue:
                raise _busy(f"{self._waiting} grammar compiles are already waiting")
            self._waiting += 1
        try:
            got = self._slots.acquire(timeout=timeout_s)
        finally:
            with self._lock:
                self._waiting -= 1
        if not got:
            raise _busy(f"no grammar compile slot freed within {timeout_s:g} s")
        try:
            yield
        finally:
            self._slots.release()

    def check(self, kind: str, text: str, timeout_s: float) -> None:
        """Compile in a child within `timeout_s` (call under `slot`): GrammarError as the
        compile raised it, or "too_slow" after the child was killed."""
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is None or not child.alive():
            child = _Child(self._ctx, self._args)
        try:
            child.wait_ready(START_TIMEOUT_S)
        except Exception:
            child.kill()
            raise
        started = time.perf_counter()
        outcome = child.compile(kind, text, timeout_s)
        if outcome is None:  # past the limit: the compile dies with its process
            child.kill()
            with self._lock:
                self.killed += 1
            self._replace()
            raise GrammarError(
                f"the {kind.replace('_', ' ')} did not compile within {timeout_s:g} s",
                "simplify it (fewer alternatives, smaller repetition counts)", reason="too_slow",
            )  # fmt: skip
        with self._lock:
            if self._closed:
                child.kill()
            else:
                self._idle.append(child)
        log.debug("grammar checked in a child in %.3f s", time.perf_counter() - started)
        if outcome[0] == "error":
            _, message, hint, reason = outcome
            raise GrammarError(message, hint, reason)

    def _replace(self) -> None:
        """A fresh child for the one killed, started now (in the background)."""
        with self._lock:
            if not self._closed and len(self._idle) < self.workers:
                self._idle.append(_Child(self._ctx, self._args))

    def pids(self) -> list[int]:
        with self._lock:
            return [c.process.pid for c in self._idle if c.process.pid is not None]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def _busy(why: str) -> GrammarError:
    return GrammarError(f"the server is busy compiling grammars ({why})",
                        "retry in a few seconds; new schemas compile once, then are cached", reason="busy")  # fmt: skip


class _Child:
    """One child process with a GrammarCompiler of its own, answering over a pipe."""

    def __init__(self, ctx, args) -> None:
        serve, *rest = args
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child_conn, *rest), name="ssdlocal-grammar-check",
                                   daemon=True)  # fmt: skip
        self.process.start()
        child_conn.close()
        self.ready = False

    def alive(self) -> bool:
        return self.process.is_alive()

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise RuntimeError("the grammar checking process did not start")
        message = self.conn.recv()
        if message[0] != "ready":
            raise GrammarError(*message[1:]) if message[0] == "error" else RuntimeError(str(message))
        self.ready = True

    def compile(self, kind: str, text: str, timeout_s: float):
        """("ok",) or ("error", message, hint, reason); None past the limit."""
        try:
            self.conn.send((kind, text))
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv()
        except (EOFError, OSError):  # the child died (out of memory, say)
            return ("error", f"the {kind.replace('_', ' ')} could not be compiled (its compile crashed)",
                    "simplify it", "too_slow")  # fmt: skip

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _serve(conn, tokenizer, vocab_size: int, eos_ids) -> None:
    """The child: build the vocabulary view, then compile what it is sent, forever."""
    from ssdlocal.core.errors import UsageError
    from ssdlocal.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    try:
        ll_tokenizer = compiler._tokenizer()
        compiler._compile("regex", "a", "regex:a", ll_tokenizer)  # imports and first use: not a grammar's time
    except UsageError as exc:
        conn.send(("error", exc.message, exc.hint, "invalid"))
        return
    conn.send(("ready",))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiler._compile(kind, text, f"{kind}:{text}", ll_tokenizer)
            conn.send(("ok",))
        except GrammarError as exc:
            conn.send(("error", exc.message, exc.hint, exc.reason))
        except Exception as exc:  # noqa: BLE001 - reported as the grammar's refusal
            conn.send(("error", f"the grammar could not be compiled: {type(exc).__name__}: {str(exc)[:200]}",
                       "check it against its specification", "invalid"))  # fmt: skip
