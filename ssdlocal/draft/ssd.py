"""Target side of SSD: the worker process handle and the SSDDrafter the engine drives.

DraftWorkerClient spawns the worker, enforces a timeout on every receive, turns a
dead or silent worker into DraftWorkerError, and always leaves no process behind on
close (SHUTDOWN, then SIGKILL; at once if the worker is broken, hung or stopped). SSDDrafter implements the Drafter
protocol: `observe` sends the outcome without waiting, so the worker's reply is
usually ready by the next `propose` (a cache hit costs only a pipe round trip).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence

from ..backup import BackupChooser
from ..config import ModelSpec, SamplingParams, SpecConfig
from ..errors import DraftWorkerError, SSDLocalError
from ..parallel.channel import QChannel, choose_q_channel, make_q_channel
from ..procs import describe_exit
from . import protocol as pr
from .base import Proposal

log = logging.getLogger(__name__)


RECV_TIMEOUT_S = 120.0  # longest wait for one reply during generation (tests lower it)
LOAD_TIMEOUT_S = 900.0  # longest wait for the draft model to load
VERIFY_DEVICE = "cpu"  # the engine builds p [B, K+1, V] on the CPU, so q is read there
_LIVE: weakref.WeakSet[DraftWorkerClient] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


class DraftWorkerClient:
    """Owns the draft worker process and the pipe to it.

    After any failed or interrupted exchange the client is `broken` (the pipe may hold
    half a message): it refuses further use and `close` kills the worker at once.
    """

    def __init__(
        self,
        model: ModelSpec,
        *,
        threads: int | None = None,
        cpus: tuple[int, ...] | None = None,
        timeout_s: float | None = None,
        load_timeout_s: float | None = None,
    ) -> None:
        import torch.multiprocessing as tmp

        from .worker import worker_main

        ctx = tmp.get_context("spawn")
        self.timeout_s = RECV_TIMEOUT_S if timeout_s is None else timeout_s
        self.load_timeout_s = LOAD_TIMEOUT_S if load_timeout_s is None else load_timeout_s
        self.vocab_size: int | None = None
        self.broken = False
        self._closed = False
        _register_atexit()  # after multiprocessing's own hook, so ours runs first
        self._conn, child = ctx.Pipe(duplex=True)
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits, so only ask for it
        # from the main thread; the worker also watches its parent pid itself.
        on_main = threading.current_thread() is threading.main_thread()
        self.proc = ctx.Process(
            target=worker_main, args=(child, os.getpid(), on_main), daemon=True, name="ssdlocal-draft"
        )
        self.proc.start()
        _LIVE.add(self)
        child.close()
        try:
            self.send(pr.Cmd.LOAD, pr.LoadMsg(model, threads, cpus))
        except BaseException:
            self.close()  # the caller never gets a handle to close
            raise

    def send(self, cmd: pr.Cmd, payload=None) -> None:
        self._check_usable()
        try:
            self._conn.send((cmd, payload))
        except (BrokenPipeError, OSError) as exc:
            self.broken = True
            raise self._dead("could not send to the draft worker") from exc
        except BaseException:
            self.broken = True
            raise

    def recv(self, expect: pr.Reply, timeout_s: float | None = None):
        """Wait for one reply of kind `expect`; raise on error, death or timeout."""
        self._check_usable()
        try:
            return self._recv(expect, self.timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.broken = True  # error reply, death, timeout or Ctrl-C: the pipe is spent
            raise

    def _recv(self, expect: pr.Reply, limit: float):
        deadline = time.monotonic() + limit
        while True:
            if self._conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._dead("the draft worker died") from exc
                if kind == pr.Reply.ERROR:
                    raise _error_from(payload)
                if kind != expect:
                    raise DraftWorkerError(
                        f"draft worker protocol error: expected {expect.name}, got {kind!r}",
                        "this is a bug; run with --verbose and report it",
                    )
                return payload
            if not self.proc.is_alive():
                raise self._dead("the draft worker died")
            if time.monotonic() >= deadline:
                raise DraftWorkerError(
                    f"the draft worker did not answer within {limit:g} s (it may be hung or stopped)",
                    "the draft device may be overloaded; try --mode sd, or a smaller draft",
                )

    def _check_usable(self) -> None:
        if self._closed or self.broken:
            raise DraftWorkerError(
                "the draft worker is " + ("closed" if self._closed else "gone after an earlier failure"),
                "create a new Engine (or rerun) to start a fresh draft worker",
            )

    def _dead(self, what: str) -> DraftWorkerError:
        self.proc.join(timeout=1.0)
        return DraftWorkerError(
            f"{what}{describe_exit(self.proc.exitcode)}",
            "the draft process was killed or crashed (out of memory?); rerun, or use --mode sd",
        )

    def wait_loaded(self) -> int:
        msg = self.recv(pr.Reply.LOADED, self.load_timeout_s)
        self.vocab_size = msg.vocab_size
        return msg.vocab_size

    def close(self) -> None:
        """Stop the worker; never hangs, never leaves a process. Idempotent.

        A healthy worker gets SHUTDOWN and a moment to exit; a broken, hung or stopped
        one (SIGTERM does not reach a SIGSTOPped process) is killed with SIGKILL.
        """
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            if not self.broken and self.proc.is_alive():
                try:
                    self._conn.send((pr.Cmd.SHUTDOWN, None))
                except (BrokenPipeError, OSError):
                    pass
                self.proc.join(timeout=2.0)
        finally:  # also after a Ctrl-C during the polite part
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5.0)
            if self.proc.is_alive():  # pragma: no cover - unkillable (D state)
                log.warning("draft worker %s did not exit after SIGKILL", self.proc.pid)
            self._conn.close()




def _register_atexit() -> None:
    """Kill workers the program forgot to close before multiprocessing's exit hook,
    which would otherwise SIGTERM and then join a stopped worker forever."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all)
        _ATEXIT_REGISTERED = True


def _close_all() -> None:
    for client in list(_LIVE):
        client.broken = True  # no polite shutdown at exit: just make sure it is gone
        client.close()


def _error_from(msg: pr.ErrorMsg) -> SSDLocalError:
    from .. import errors

    cls = getattr(errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, SSDLocalError)):
        cls = DraftWorkerError
    return cls(msg.message, msg.hint)


class SSDDrafter:
    """Drafter protocol over the async worker: propose waits, observe does not."""

    def __init__(
        self,
        client: DraftWorkerClient,
        spec: SpecConfig,
        params: SamplingParams,
        target_vocab: int,
        num_slots: int,
        *,
        target_device: str = "cpu",
        draft_device: str = "cpu",
    ) -> None:
        self.client = client
        self.target_device = target_device  # rank 0 of the target: where the q buffer lives
        self.draft_device = draft_device
        self.k = spec.k
        self.spec = spec
        self.params = params
        self.target_vocab = target_vocab
        self.num_slots = num_slots
        self._round = 0
        self._first = True
        self._sent_at = 0.0
        self._proposed_at = 0.0
        self._prev: list[list[int]] = []
        self._q_channel: QChannel | None = None  # None when greedy (no q)
        self.chooser = BackupChooser(spec.backup, spec.k)
        self.last: pr.ProposalMsg | None = None
        self._awaiting = False  # a PROPOSAL reply is owed by the worker

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        batch = len(sequences)
        self._q_channel = None
        if not self.params.greedy:
            choice = choose_q_channel(self.target_device, self.draft_device)
            log.debug("q channel: %s (%s)", choice.kind, choice.reason)
            self._q_channel = make_q_channel(choice, batch, self.k, self.target_vocab, self.target_device)
        msg = pr.StartMsg(
            sequences=tuple(tuple(s) for s in sequences),
            params=self.params,
            k=self.k,
            num_slots=self.num_slots,
            target_vocab=self.target_vocab,
            fan_out=self.spec.fan_out,
            fan_out_miss=self.spec.fan_out_miss,
            saguaro_c=self.spec.saguaro_c,
            backup=self.spec.backup,
            q_buffer=None if self._q_channel is None else self._q_channel.buffer,
        )
        self.client.send(pr.Cmd.START, msg)
        self.client.recv(pr.Reply.READY)
        self._prev = [list(s) for s in sequences]
        self._first = True

    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        if self._first:
            self.client.send(pr.Cmd.FIRST)
            self._first = False
            self._awaiting = True
        self._awaiting = False  # on failure the pipe is unusable anyway
        msg: pr.ProposalMsg = self.client.recv(pr.Reply.PROPOSAL)
        self.last = msg
        self._proposed_at = time.perf_counter()
        tokens = [list(t) for t in msg.tokens]
        q = None
        if msg.q_written and self._q_channel is not None:
            q = self._q_channel.read(VERIFY_DEVICE)  # [B, K, V] where the engine's p lives
        self.chooser.observe_proposal(msg)
        return Proposal(
            tokens=tokens, q=q, cache_hit=list(msg.cache_hit), backup=msg.backup, draft_busy_s=msg.busy_s
        )

    def observe(self, sequences, n_accepted, bonus, active) -> None:
        verify_s = time.perf_counter() - self._proposed_at
        if not any(active):
            return  # generation is over; the worker needs no outcome
        appended = tuple(tuple(s[len(p) :]) for s, p in zip(sequences, self._prev))
        if self.last is not None:
            for b, n in enumerate(n_accepted):
                if appended[b] and b < len(self.last.cache_hit):
                    path = "hit" if self.last.cache_hit[b] else (self.last.backup or "jit")
                    if path in ("hit", "jit", "ngram"):
                        self.chooser.observe_tokens(path, len(appended[b]))
        self._prev = [list(s) for s in sequences]
        backup = self.chooser.choose(sum(active), verify_s)
        msg = pr.OutcomeMsg(
            round_index=self._round,
            appended=appended,
            n_accepted=tuple(int(n) for n in n_accepted),
            bonus=tuple(int(x) for x in bonus),
            active=tuple(bool(a) for a in active),
            verify_s=verify_s,
            backup=backup,
        )
        self._round += 1
        self.client.send(pr.Cmd.OUTCOME, msg)
        self._awaiting = True

    def close(self) -> None:
        """End of one generate call: collect a reply still owed (after a cancel) so the
        pipe is clean for the next batch. The worker itself lives on. After a failure
        the client is broken and there is nothing to collect (close kills the worker)."""
        if self._awaiting and not self.client.broken and not self.client._closed:
            self._awaiting = False
            self.client.recv(pr.Reply.PROPOSAL)
        self._awaiting = False
