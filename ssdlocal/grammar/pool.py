"""Grammar compiles bounded as a resource: a few child processes that can be killed.

llguidance cannot be interrupted once a compile runs, and a thread left running past the
time limit keeps its CPU and memory. `CompilePool` first compiles each new grammar in a
child process (`workers` of them, kept warm with the vocabulary view built; plain `python -m` processes
that import llguidance and nothing of the server): one that
does not finish within the limit is killed, so a refused compile stops using CPU and
memory at once, and a fresh child replaces it. Only a grammar that compiled there in time
is compiled again in the server's process (the same work, so bounded by the same limit).
At most `workers` compiles run at a time; at most `queue` more wait for one (bounded by
the same time limit), and the rest are refused at once (reason "busy"). Knows nothing of
HTTP.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection

from ssdlocal.grammar.compiler import GrammarError
from ssdlocal.grammar.kinds import GrammarKind

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a child's start-up (imports and the vocabulary view): not a grammar's fault


class CompilePool:
    """Child processes that check that grammars compile in time (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, *, workers: int = 1, queue: int = 8, serve=None) -> None:
        """`tokenizer`: the served model's fast tokenizer (its JSON goes to the children,
        which need neither transformers nor torch); `serve`: the children's main function
        (default: compile with llguidance), a module-level function taking (connection,
        vocabulary JSON, vocab_size, eos_ids)."""
        self.tokenizer = tokenizer
        self._serve = serve or _serve
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._args = None  # built on the first child (the tokenizer's JSON)
        self.workers = workers
        self.queue = queue
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
                self._idle.append(_Child(self._child_args()))

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until the children started now have built their vocabulary view (a child
        that fails to start is reported at the first compile, as before)."""
        with self._lock:
            children = list(self._idle)
        for child in children:
            try:
                child.wait_ready(timeout_s)
            except (RuntimeError, GrammarError, EOFError, OSError):
                log.debug("a grammar child did not start", exc_info=True)

    def _child_args(self):
        if self._args is None:
            from ssdlocal.grammar.compiler import vocabulary_json

            self._args = (self._serve, vocabulary_json(self.tokenizer), self._vocab_size, self._eos_ids)
        return self._args

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

    def check(self, kind: GrammarKind, text: str, timeout_s: float) -> None:
        """Compile `text` as a `kind` grammar in a child within `timeout_s` (call under
        `slot`): GrammarError as the compile raised it, or "too_slow" after the child was
        killed."""
        kind = GrammarKind.parse(kind, "grammar kind")
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is None or not child.alive():
            with self._lock:
                args = self._child_args()
            child = _Child(args)
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
                f"the {kind.words} did not compile within {timeout_s:g} s",
                "simplify it (fewer alternatives, smaller repetition counts)",
                reason="too_slow",
            )
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
                self._idle.append(_Child(self._child_args()))

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
    return GrammarError(
        f"the server is busy compiling grammars ({why})",
        "retry in a few seconds; new schemas compile once, then are cached",
        reason="busy",
    )


class _Child:
    """One child process (`python -m ssdlocal.grammar.pool`: it imports llguidance and
    nothing of the server, not torch) answering over a socket."""

    def __init__(self, args) -> None:
        serve, *rest = args
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        target = f"{serve.__module__}:{serve.__qualname__}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ssdlocal.grammar.pool", str(theirs.fileno()), target],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(tuple(rest))
        self.ready = False
        self._starting = threading.Lock()  # wait_started's thread and a compile may both wait for "ready"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the child's "ready" (its vocabulary view built); one reader at a time,
        so a second waiter sees `ready` instead of reading the socket beside the first."""
        if not self._starting.acquire(timeout=timeout_s):
            raise RuntimeError("the grammar checking process did not start")
        try:
            if self.ready:
                return
            if not self.conn.poll(timeout_s):
                raise RuntimeError("the grammar checking process did not start")
            message = self.conn.recv()
            if message[0] != "ready":
                raise GrammarError(*message[1:]) if message[0] == "error" else RuntimeError(str(message))
            self.ready = True
        finally:
            self._starting.release()

    def compile(self, kind: GrammarKind, text: str, timeout_s: float):
        """("ok",) or ("error", message, hint, reason); None past the limit."""
        try:
            self.conn.send((kind, text))
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv()
        except (EOFError, OSError):  # the child died (out of memory, say)
            return ("error", f"the {kind.words} could not be compiled (its compile crashed)", "simplify it", "too_slow")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill is not refused
            log.warning("a grammar checking process did not exit")
        self.conn.close()


def _serve(conn, vocabulary: str, vocab_size: int, eos_ids) -> None:
    """The child: build the vocabulary view, then compile what it is sent, forever."""
    from ssdlocal.core.errors import UsageError
    from ssdlocal.grammar.compiler import GrammarCompiler, require_llguidance

    compiler = GrammarCompiler(None, vocab_size, eos_ids)
    try:
        llg = require_llguidance(hf=False)
        ll_tokenizer = llg.LLTokenizer(vocabulary, n_vocab=vocab_size, eos_token=list(eos_ids))
        compiler._compile(GrammarKind.REGEX, "a", "regex:a", ll_tokenizer)  # first use: not a grammar's time
    except UsageError as exc:
        conn.send(("error", exc.message, exc.hint, "invalid"))
        return
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"the grammar engine could not start: {str(exc)[:200]}", "", "invalid"))
        return
    conn.send(("ready",))
    answer_forever(conn, lambda kind, text: compiler._compile(kind, text, f"{kind}:{text}", ll_tokenizer))


def answer_forever(conn, compile_one) -> None:
    """The child's loop: receive (kind, text), run `compile_one(kind, text)`, answer ("ok",)
    or ("error", message, hint, reason); return when the parent's end closes."""
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compile_one(kind, text)
            conn.send(("ok",))
        except GrammarError as exc:
            conn.send(("error", exc.message, exc.hint, exc.reason))
        except Exception as exc:  # noqa: BLE001 - reported as the grammar's refusal
            conn.send(
                (
                    "error",
                    f"the grammar could not be compiled: {type(exc).__name__}: {str(exc)[:200]}",
                    "check it against its specification",
                    "invalid",
                )
            )


def _main(argv: list[str]) -> None:
    """`python -m ssdlocal.grammar.pool FD MODULE:FUNCTION`: run FUNCTION(connection, *the
    first message) on the socket FD."""
    conn = Connection(int(argv[0]))
    module, _, name = argv[1].partition(":")
    serve = getattr(importlib.import_module(module), name)
    try:
        args = conn.recv()
    except (EOFError, OSError):
        return
    serve(conn, *args)


if __name__ == "__main__":
    _main(sys.argv[1:])
