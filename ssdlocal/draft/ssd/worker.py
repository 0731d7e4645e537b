"""The SSD draft worker process: owns the draft model, its KV cache and the speculation cache.

Started by DraftWorkerClient (client.py) through ssdlocal.ipc. Talks only in the typed
messages of protocol.py. After answering each proposal it pre-speculates for that
proposal's outcomes while the target verifies. Exits on SHUTDOWN, when the pipe
closes, or when its parent dies.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ssdlocal.core.hostsync import Audit, HostWaits
from ssdlocal.draft.ssd.protocol import (
    Cmd,
    LoadedMsg,
    LoadMsg,
    OutcomeMsg,
    ProposalMsg,
    Reply,
    StartMsg,
)

if TYPE_CHECKING:  # the worker imports torch and the speculator once it runs
    import torch

    from ssdlocal.draft.ssd.speculator import Speculator


log = logging.getLogger(__name__)


def worker_main(conn, parent_pid: int, pdeathsig: bool = True) -> None:
    """Process entry point. `conn` is the worker's end of the pipe (see ipc.ChildProcess)."""
    from ssdlocal.ipc.serve import run_child, serve

    worker = DraftWorker(conn)
    run_child(
        conn,
        parent_pid,
        pdeathsig,
        lambda: serve(conn, parent_pid, worker.handle),
        role="draft worker",
        default_kind="DraftWorkerError",
    )


class DraftWorker:
    """The worker's state between messages: the runner, the batch's Speculator, timings."""

    def __init__(self, conn) -> None:
        self.conn = conn
        # the draft model's runner: a backend's own class, whose prefix store (`prefix`,
        # `prefix_report`) the worker reaches past the Runner protocol
        self.runner: Any = None
        self.spec: Speculator | None = None  # of the current batch
        self.q_buffer: torch.Tensor | None = None
        self.prespec_s = 0.0  # the pre-speculation that preceded the next proposal
        self.round_index = 0
        self.audit = Audit()  # this process's host waits (core.hostsync), reported with each proposal

    def handle(self, cmd, payload) -> None:
        t0 = time.perf_counter()
        if cmd == Cmd.LOAD:
            self._load(payload)
        elif cmd == Cmd.START:
            self._start(payload)
        elif cmd == Cmd.FIRST:
            self._propose(self._speculator().first(payload), time.perf_counter() - t0)
        elif cmd == Cmd.OUTCOME:
            self._outcome(payload, t0)
        elif cmd == Cmd.FORGET:
            if self.runner is not None:
                self.runner.forget_prefixes()
        else:
            raise RuntimeError(f"unknown command {cmd!r}")

    def _load(self, msg: LoadMsg) -> None:
        from ssdlocal.backends import registry
        from ssdlocal.core.memory import keep_freed_memory

        keep_freed_memory()
        _apply_placement(msg)
        loaded = registry.load(msg.model, threads=msg.threads)
        registry.claim_device(msg.model.device)
        self.runner = registry.make_runner(loaded, tree=True, graphs=msg.graphs)
        self.runner.setup_prefix(msg.prefix_tokens)
        self.audit.watch(self.runner, "worker")
        reply = LoadedMsg(loaded.args.vocab_size, str(loaded.device), loaded.args.max_position_embeddings)
        self.conn.send((Reply.LOADED, reply))

    def _start(self, msg: StartMsg) -> None:
        from ssdlocal.draft.ssd.speculator import Speculator

        if self.runner is None:
            raise RuntimeError("START before LOAD")  # the client always loads first
        if self.spec is not None:  # what the last batch left: later prompts may start from it
            self.spec.store_prefixes()
            self.spec = None
        self.spec = Speculator(self.runner, msg, audit=self.audit)
        self.q_buffer = msg.q_buffer
        self.round_index = 0
        self.conn.send(
            (
                Reply.READY,
                {"graphs": self._graphs(), "prefix": self.runner.prefix_report(), "host_waits": self._host_waits()},
            )
        )

    def _speculator(self) -> Speculator:
        if self.spec is None:
            raise RuntimeError("a round before START")  # the client always starts a batch first
        return self.spec

    def _outcome(self, msg: OutcomeMsg, t0: float) -> None:
        spec = self._speculator()
        self.round_index = msg.round_index + 1
        for planner in (spec.plan_hit, spec.plan_miss):
            planner.observe_timing(self.prespec_s, msg.verify_s, spec.last_depth >= spec.k)
        served = spec.resolve(msg)
        self._propose(served, self.prespec_s + (time.perf_counter() - t0))
        if msg.ahead is not None:
            self._read_ahead(*msg.ahead)

    def _read_ahead(self, tokens: tuple[int, ...], n: int) -> None:
        """Up to `n` more of a waiting prompt into the prefix store, after pre-speculation
        and whether or not the next outcome waits: the target reads the same chunk between
        its rounds, and a draft read only when idle falls behind (measured: it then held
        about a third of a 787-token prompt when the row was seated, and read the rest at
        START while every row waited). A failure costs only the reading ahead (the rest is
        read at START), never the running batch's rounds."""
        import torch

        from ssdlocal.core.errors import SSDLocalError

        try:
            self.runner.read_ahead(tokens, n)
        except (SSDLocalError, torch.OutOfMemoryError, RuntimeError) as exc:
            log.warning("reading a waiting prompt ahead failed: %s", exc)

    def _propose(self, served, busy_s: float) -> None:
        """Send the proposal, then pre-speculate its outcomes while the target verifies."""
        from ssdlocal.ipc.qchannel import write_q

        spec = self._speculator()
        q_written = False
        if served.q is not None and self.q_buffer is not None:
            write_q(self.q_buffer, served.q)  # [n, K, V]; synchronizes a CUDA buffer first
            self.audit.site("worker").waited()  # the target reads q once it has the message
            q_written = True
        msg = ProposalMsg(
            self.round_index,
            tuple(tuple(t) for t in served.tokens),
            tuple(served.cache_hit),
            served.backup,
            q_written,
            busy_s,
            self.prespec_s,
            spec.last_fan,
            self._graphs(),
            self._host_waits(),
        )
        self.conn.send((Reply.PROPOSAL, msg))
        self.prespec_s = spec.prespeculate(spec.early_stop(self.conn.poll))

    def _host_waits(self) -> dict:
        return self.audit.snapshot().get("worker", HostWaits()).as_dict()

    def _graphs(self) -> dict:
        return self.runner.graph_report()


def _apply_placement(msg: LoadMsg) -> None:
    """The CPU cores and thread count the engine gave this process."""
    import torch

    if msg.cpus and hasattr(os, "sched_setaffinity"):
        from ssdlocal.placement.cpus import set_process_affinity

        set_process_affinity(msg.cpus)
    if msg.threads:
        torch.set_num_threads(msg.threads)
