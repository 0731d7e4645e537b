"""A tensor-parallel target: rank 0 in this process (it runs the engine), one spawned
process per other rank, each holding a shard (tp.py) on its own device.

Rank 0 wraps its shard in `TPModel`, which ModelRunner uses like a plain Transformer:
before each forward it sends a small header (op, shapes) down a pipe to every rank,
broadcasts ids/positions/slots/mask with torch.distributed, and runs its shard; the
ranks run the same forward, so every all_reduce meets its partners. Idle ranks wait on
the pipe (with a parent-death check), never inside a collective, so an idle engine
cannot time out, while every collective has the process group's timeout.
Robustness follows draft/ssd.py: rendezvous on a port the OS picks (TCPStore bound to
port 0 on 127.0.0.1), a watchdog thread that notices a dead rank, a broken group that
refuses further use, SHUTDOWN then SIGKILL on close, an atexit hook, PDEATHSIG.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch

from ..config import ModelSpec
from ..errors import OutOfMemoryError, SSDLocalError, UsageError
from ..procs import describe_exit
from .rank import (
    Cmd,
    RankError,
    Reply,
    TensorParallelError,
    pack_inputs,
    rank_main,
)

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 60.0  # spawn + import + joining the process group
COLLECTIVE_TIMEOUT_S = 120.0  # any one broadcast / all_reduce (tests lower it)
LOAD_TIMEOUT_S = 900.0  # loading and sharding the checkpoint on every rank
_LIVE: weakref.WeakSet[RankGroup] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def backend_for(devices: tuple[str, ...]) -> str:
    """NCCL when every rank is a CUDA device, gloo when every rank is the CPU."""
    kinds = {d.split(":")[0] for d in devices}
    if kinds == {"cuda"}:
        if len(set(devices)) != len(devices):
            raise TensorParallelError(
                f"target devices repeat a GPU: {', '.join(devices)}",
                "give each tensor-parallel rank its own GPU, e.g. --target-devices cuda:0-1",
            )
        return "nccl"
    if kinds == {"cpu"}:
        return "gloo"
    raise TensorParallelError(
        f"target devices mix kinds: {', '.join(devices)}",
        "use only GPUs (cuda:0-3) or only the CPU for a tensor-parallel target",
    )


# --------------------------------------------------------------------------- rank 0


class TPModel:
    """What ModelRunner sees on rank 0: the local shard, mirrored on every other rank."""

    def __init__(self, shard, group: RankGroup) -> None:
        self.shard = shard
        self.group = group
        self.args = shard.args  # per-rank head counts
        self.layers = shard.layers

    def setup_cache(self, batch_size: int, num_slots: int, dtype, device) -> None:
        self.group.command_all(Cmd.CACHE, (batch_size, num_slots))
        self.shard.setup_cache(batch_size, num_slots, dtype, device)
        self.group.collect_acks()

    def __call__(self, ids, positions, slots, mask):
        """ids/positions/slots [B, T] long, mask [B, T, S] bool (on rank 0's device) -> logits."""
        return self.group.forward(self.shard, ids, positions, slots, mask)


class RankGroup:
    """Owns ranks 1..N-1 (processes), the pipes to them and the default process group."""

    def __init__(
        self,
        spec: ModelSpec,
        devices: tuple[str, ...],
        *,
        rendezvous_timeout_s: float | None = None,
        collective_timeout_s: float | None = None,
        load_timeout_s: float | None = None,
    ) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as tmp

        self.devices = tuple(devices)
        self.world = len(devices)
        self.backend = backend_for(self.devices)
        self.rendezvous_timeout_s = rendezvous_timeout_s or RENDEZVOUS_TIMEOUT_S
        self.collective_timeout_s = collective_timeout_s or COLLECTIVE_TIMEOUT_S
        self.load_timeout_s = load_timeout_s or LOAD_TIMEOUT_S
        self.device = torch.device(devices[0])
        self.broken = False
        self._closed = False
        self._dead: str | None = None  # set by the watchdog: which rank died and how
        self.procs, self.conns = [], []
        if not dist.is_available():
            raise TensorParallelError("this torch build has no torch.distributed",
                                      "install a torch build with distributed support")
        if dist.is_initialized():
            raise TensorParallelError(
                "a tensor-parallel target is already running in this process",
                "close the other Engine first (one tensor-parallel group per process)",
            )
        if self.backend == "gloo" and sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        if self.backend == "nccl":
            # On a collective timeout NCCL's own watchdog aborts the communicators and lets
            # the error surface here (mode 2) instead of tearing down the user's process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        _register_atexit()
        _LIVE.add(self)
        try:
            # The OS picks a free port: no race with other programs, no fixed port.
            store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True,
                                  timeout=timedelta(seconds=self.rendezvous_timeout_s),
                                  wait_for_workers=False)
            ctx = tmp.get_context("spawn")
            on_main = threading.current_thread() is threading.main_thread()
            threads = max(1, torch.get_num_threads() // self.world) if self.backend == "gloo" else None
            for rank in range(1, self.world):
                conn, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=rank_main,
                    args=(child, rank, self.world, store.port, self.backend, self.devices, spec,
                          os.getpid(), on_main, self.rendezvous_timeout_s, self.collective_timeout_s,
                          threads),
                    daemon=True,
                    name=f"ssdlocal-tp{rank}",
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(conn)
            for rank in range(1, self.world):
                self._recv(rank, Reply.JOINING, self.rendezvous_timeout_s)
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
            try:
                dist.init_process_group(self.backend, store=store, rank=0, world_size=self.world,
                                        timeout=timedelta(seconds=self.collective_timeout_s))
            except RuntimeError as exc:  # a rank died or hung while joining
                raise self.failure(f"the tensor-parallel ranks could not join ({_first_line(exc)})") from exc
            self._store = store
            self._watchdog = threading.Thread(target=self._watch, name="ssdlocal-tp-watchdog",
                                              daemon=True)
            self._watchdog.start()
        except BaseException:
            self.broken = True
            self.close()
            raise

    # ---- messaging
    def _recv(self, rank: int, expect: Reply, limit: float):
        """Wait for one reply of kind `expect` from `rank`; raise on error, death or timeout."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + limit
        while True:
            if conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError) as exc:
                    self.broken = True
                    raise self.failure(f"tensor-parallel rank {rank} died") from exc
                if kind == Reply.ERROR:
                    self.broken = True
                    raise _error_from(payload)
                if kind != expect:
                    self.broken = True
                    raise TensorParallelError(
                        f"tensor-parallel protocol error: rank {rank} sent {kind!r}, expected {expect.name}",
                        "this is a bug; run with --verbose and report it",
                    )
                return payload
            if not proc.is_alive():
                self.broken = True
                raise self.failure(f"tensor-parallel rank {rank} died")
            if time.monotonic() >= deadline:
                self.broken = True
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} ({self.devices[rank]}) did not answer within {limit:g} s",
                    "the device may be overloaded or the process stopped; rerun, or use one target device",
                )

    def command_all(self, cmd: Cmd, payload) -> None:
        self._check_usable()
        try:
            for conn in self.conns:
                conn.send((cmd, payload))
        except BaseException as exc:
            self.broken = True
            if isinstance(exc, (BrokenPipeError, OSError)):
                raise self.failure("could not reach a tensor-parallel rank") from exc
            raise

    def wait_loaded(self) -> list[int]:
        """Bytes of parameters on each other rank, once all have loaded their shard."""
        return [self._recv(r, Reply.LOADED, self.load_timeout_s) for r in range(1, self.world)]

    def collect_acks(self) -> None:
        for rank in range(1, self.world):
            self._recv(rank, Reply.ACK, self.collective_timeout_s)

    def _check_usable(self) -> None:
        if self._closed or self.broken:
            raise TensorParallelError(
                "the tensor-parallel target is " + ("closed" if self._closed else "gone after an earlier failure")
                + (f" ({self._dead})" if self._dead else ""),
                "create a new Engine (or rerun) to start the ranks again",
            )
        if self._dead:
            self.broken = True
            raise self.failure("a tensor-parallel rank died")

    # ---- the mirrored forward
    def forward(self, shard, ids, positions, slots, mask):
        import torch.distributed as dist

        B, T = ids.shape
        S = mask.shape[-1]
        self.command_all(Cmd.FORWARD, (B, T, S))
        try:
            dist.broadcast(pack_inputs(ids, positions, slots, mask).to(self.device), 0)  # one collective
            return shard(ids, positions, slots, mask)  # [B, T, V]; all_reduce inside
        except BaseException as exc:
            self.broken = True  # a rank may be waiting in a collective: the group is spent
            if isinstance(exc, torch.OutOfMemoryError):
                raise OutOfMemoryError(
                    f"out of memory on {self.device} in the tensor-parallel forward",
                    "use fewer prompts, a smaller --max-new-tokens, or more target devices",
                ) from exc
            if isinstance(exc, RuntimeError):  # gloo/NCCL errors, timeouts (DistBackendError)
                raise self.failure(f"a tensor-parallel collective failed ({_first_line(exc)})") from exc
            raise

    def failure(self, what: str) -> SSDLocalError:
        """The best account of why the group failed: a rank's own error, else its exit."""
        time.sleep(0.05)  # a crashing rank's ERROR reply may still be in flight
        for rank in range(1, self.world):
            conn, proc = self.conns[rank - 1], self.procs[rank - 1]
            try:
                while conn.poll(0.2 if not proc.is_alive() else 0):
                    kind, payload = conn.recv()
                    if kind == Reply.ERROR:
                        return _error_from(payload)
            except (EOFError, OSError):
                pass
        for rank in range(1, self.world):
            proc = self.procs[rank - 1]
            proc.join(timeout=0.5 if not proc.is_alive() else 0)
            if proc.exitcode is not None:
                return TensorParallelError(
                    f"{what}: rank {rank} ({self.devices[rank]}) exited{describe_exit(proc.exitcode)}",
                    "the rank was killed or crashed (out of memory?); rerun, or use fewer target devices",
                )
        return TensorParallelError(
            f"{what}",
            "a rank may be hung or its device overloaded; rerun with --verbose, or use one target device",
        )

    def _watch(self, every_s: float = 0.2) -> None:
        """Notice a dead rank between and during forwards; abort NCCL so rank 0 does not
        sit in a collective until the timeout (gloo fails at once when a peer's socket closes)."""
        while not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive() and not self._closed and self._dead is None:
                    self._dead = f"rank {rank} ({self.devices[rank]}) exited{describe_exit(proc.exitcode)}"
                    log.warning("tensor-parallel %s", self._dead)
                    if self.backend == "nccl":
                        _abort_nccl()
            time.sleep(every_s)

    # ---- shutdown
    def close(self) -> None:
        """Stop every rank and leave the process group; never hangs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            if not self.broken:
                for conn in self.conns:
                    try:
                        conn.send((Cmd.SHUTDOWN, None))
                    except (BrokenPipeError, OSError):
                        pass
                for proc in self.procs:
                    proc.join(timeout=5.0)
        finally:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5.0)
                if proc.is_alive():  # pragma: no cover - unkillable (D state)
                    log.warning("tensor-parallel rank %s did not exit after SIGKILL", proc.pid)
            for conn in self.conns:
                conn.close()
            _leave_process_group(self.broken)


def _leave_process_group(broken: bool) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if broken and dist.get_backend() == "nccl":
            _abort_nccl()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the peers are gone; nothing left to tidy
        log.debug("destroy_process_group failed: %s", exc)


def _abort_nccl() -> None:
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except Exception as exc:  # noqa: BLE001
            log.debug("NCCL abort failed: %s", exc)


def load_tensor_parallel(spec: ModelSpec, devices: tuple[str, ...], **timeouts):
    """Start the ranks, load the shards everywhere; returns (LoadedModel on rank 0, RankGroup).

    The LoadedModel's `model` is a TPModel, so ModelRunner drives the whole group.
    """
    from ..backends.torch_backend.loader import load_hf_config, resolve_checkpoint
    from ..backends.torch_backend.model import ModelArgs
    from .tp import check_divisible

    if getattr(spec, "backend", "torch") != "torch":
        raise UsageError(
            f"tensor parallelism needs the torch backend, not {spec.backend}",
            "drop --target-devices, or load the checkpoint with the torch backend",
        )
    args = ModelArgs.from_hf_config(load_hf_config(resolve_checkpoint(spec.path)))
    check_divisible(args.num_heads, args.num_kv_heads, args.intermediate_size, len(devices))
    group = RankGroup(spec, devices, **timeouts)
    try:
        from .shard_loader import load_shard

        loaded = load_shard(spec, devices[0], 0, len(devices))
        group.wait_loaded()
        loaded.model = TPModel(loaded.model, group)
        return loaded, group
    except BaseException:
        group.broken = True
        group.close()
        raise


def _error_from(msg: RankError) -> SSDLocalError:
    from .. import errors

    cls = getattr(errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, SSDLocalError)):
        cls = TensorParallelError
    return cls(msg.message, msg.hint)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _register_atexit() -> None:
    """Kill ranks the program forgot to close, before multiprocessing's own exit hook."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all)
        _ATEXIT_REGISTERED = True


def _close_all() -> None:
    for group in list(_LIVE):
        group.broken = True
        group.close()
