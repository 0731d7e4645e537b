"""The SSD draft worker process: owns the draft model, its KV cache and the speculation cache.

Started with the `spawn` method by DraftWorkerClient. Talks only through typed
messages (protocol.py). After answering each proposal it pre-speculates for that
proposal's outcomes while the target verifies. Exits on SHUTDOWN, when the pipe
closes, or when its parent dies (PR_SET_PDEATHSIG on Linux, plus a ppid check).
"""

from __future__ import annotations

import logging
import os
import time
import traceback

from ..procs import start_child
from .protocol import (
    Cmd,
    ErrorMsg,
    LoadedMsg,
    LoadMsg,
    OutcomeMsg,
    ProposalMsg,
    Reply,
    StartMsg,
)

log = logging.getLogger(__name__)


def _apply_placement(msg: LoadMsg) -> None:
    import torch

    if msg.cpus and hasattr(os, "sched_setaffinity"):
        from ..placement import set_process_affinity

        set_process_affinity(msg.cpus)
    if msg.threads:
        torch.set_num_threads(msg.threads)


def worker_main(conn, parent_pid: int, pdeathsig: bool = True) -> None:
    """Process entry point. `conn` is the worker's end of a multiprocessing Pipe.

    `pdeathsig`: see ssdlocal.procs.start_child.
    """
    start_child(parent_pid, pdeathsig)
    try:
        _serve(conn, parent_pid)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # parent went away: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - report anything else, then exit non-zero
        _send_error(conn, exc)
        os._exit(1)


def _send_error(conn, exc: BaseException) -> None:
    from ..errors import SSDLocalError

    if isinstance(exc, SSDLocalError):
        msg = ErrorMsg(exc.message, exc.hint, type(exc).__name__)
    else:
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        msg = ErrorMsg(f"draft worker crashed: {tail}", "run with --verbose and report the bug", "DraftWorkerError")
    try:
        conn.send((Reply.ERROR, msg))
    except (OSError, EOFError):
        pass


def _serve(conn, parent_pid: int) -> None:
    from ..backends.torch_backend.loader import load_model
    from ..backends.torch_backend.runner import ModelRunner
    from ..parallel.channel import write_q
    from .speculator import Served, Speculator

    runner = None
    spec: Speculator | None = None
    q_buffer = None
    busy_s = 0.0
    prespec_s = 0.0
    round_index = 0

    def send_proposal(served: Served, busy: float) -> None:
        q_written = False
        if served.q is not None and q_buffer is not None:
            write_q(q_buffer, served.q)  # [n, K, V]; synchronizes a CUDA buffer before the reply
            q_written = True
        conn.send(
            (
                Reply.PROPOSAL,
                ProposalMsg(
                    round_index,
                    tuple(tuple(t) for t in served.tokens),
                    tuple(served.cache_hit),
                    served.backup,
                    q_written,
                    busy,
                    prespec_s,
                    spec.last_fan if spec else (),
                ),
            )
        )

    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
            continue
        cmd, payload = conn.recv()
        t0 = time.perf_counter()
        if cmd == Cmd.SHUTDOWN:
            return
        if cmd == Cmd.LOAD:
            assert isinstance(payload, LoadMsg)
            _apply_placement(payload)
            if payload.model.backend == "llamacpp":  # GGUF through llama.cpp, SSD tree via sequences
                from ..backends.llamacpp import LlamaCppRunner, load_gguf

                loaded = load_gguf(payload.model.path, payload.model.device, payload.threads)
                runner = LlamaCppRunner(loaded, tree=True)
            else:
                loaded = load_model(payload.model.path, payload.model.device, payload.model.dtype)
                runner = ModelRunner(loaded)
            conn.send((Reply.LOADED, LoadedMsg(loaded.args.vocab_size, str(loaded.device))))
        elif cmd == Cmd.START:
            assert isinstance(payload, StartMsg) and runner is not None
            spec = Speculator(runner, payload)
            q_buffer = payload.q_buffer
            round_index = 0
            conn.send((Reply.READY, None))
        elif cmd == Cmd.FIRST:
            served = spec.first()
            send_proposal(served, time.perf_counter() - t0)
            prespec_s = spec.prespeculate(spec.early_stop(conn.poll))
        elif cmd == Cmd.OUTCOME:
            assert isinstance(payload, OutcomeMsg)
            round_index = payload.round_index + 1
            for planner in (spec.plan_hit, spec.plan_miss):
                planner.observe_timing(prespec_s, payload.verify_s, spec.last_depth >= spec.k)
            served = spec.resolve(payload)
            busy_s = prespec_s + (time.perf_counter() - t0)
            send_proposal(served, busy_s)
            prespec_s = spec.prespeculate(spec.early_stop(conn.poll))
        else:
            raise RuntimeError(f"unknown command {cmd!r}")
