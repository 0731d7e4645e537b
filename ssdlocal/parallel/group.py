"""A tensor-parallel target: rank 0 in this process (it runs the engine), one spawned
process per other rank, each holding a shard (tp.py) on its own device.

Rank 0 wraps its shard in `TPModel` (tpmodel.py), which TorchRunner uses like a plain model:
before each forward it sends a small header (op, shapes) down a pipe to every rank,
broadcasts ids/positions/slots/mask with torch.distributed, and runs its shard; the
ranks run the same forward, so every all_reduce meets its partners.
Decode and tree steps are captured on every rank (graphs.py, when the runner's graph mode
gives a backend): each rank holds one graph per shape with its all_reduces inside, and
the inputs are broadcast outside the graph, then copied into its static buffers. Rank 0's
GraphCache decides; each primitive it runs (eager, capture, replay) is sent to the ranks
with the graph key first (the forward's header carries the first), so all ranks capture,
replay and fall back together and every collective meets its partners. Idle ranks wait on
the pipe (with a parent-death check), never inside a collective, so an idle engine
cannot time out, while every collective has the process group's timeout.
Each rank is an ipc.ChildProcess (deadline receives, SHUTDOWN then SIGKILL on close,
killed at exit if forgotten, dies with its parent); on top of that the group
rendezvouses on a loopback port the OS picks (nothing listens beyond this machine), runs a watchdog thread that notices a dead rank,
and refuses further use once broken.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch

from ssdlocal.core.config import ModelSpec
from ssdlocal.core.errors import SSDLocalError, TensorParallelError, UsageError
from ssdlocal.core.memory import oom_error
from ssdlocal.ipc.lifetime import describe_exit
from ssdlocal.ipc.child import ChildProcess
from ssdlocal.parallel.rank import Cmd, RankSetup, Reply, pack_inputs, pin_to_loopback, rank_main
from ssdlocal.parallel.tpmodel import TPModel

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 60.0  # spawn + import + joining the process group
COLLECTIVE_TIMEOUT_S = 120.0  # any one broadcast / all_reduce (tests lower it)
LOAD_TIMEOUT_S = 900.0  # loading and sharding the checkpoint on every rank


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


class RankGroup:
    """Owns ranks 1..N-1 (ipc.ChildProcess each) and the default process group."""

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
        self.children: list[ChildProcess] = []
        if not dist.is_available():
            raise TensorParallelError(
                "this torch build has no torch.distributed", "install a torch build with distributed support"
            )
        if dist.is_initialized():
            raise TensorParallelError(
                "a tensor-parallel target is already running in this process",
                "close the other Engine first (one tensor-parallel group per process)",
            )
        pin_to_loopback(self.backend)  # every rank is on this machine
        if self.backend == "nccl":
            # On a collective timeout NCCL's own watchdog aborts the communicators and lets
            # the error surface here (mode 2) instead of tearing down the user's process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        try:
            self._start(spec, dist)
        except BaseException:
            self.broken = True
            self.close()
            raise

    def _start(self, spec: ModelSpec, dist) -> None:
        """Rendezvous, spawn the ranks, join the process group, start the watchdog."""
        # The store has no authentication, so it must not listen beyond this machine: a
        # TCPStore master binds every interface whatever host it is given, so it gets a
        # socket already bound to loopback, on a free port the OS picks.
        listener = loopback_listener()
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                listener.getsockname()[1],
                self.world,
                is_master=True,
                master_listen_fd=listener.fileno(),
                timeout=timedelta(seconds=self.rendezvous_timeout_s),
                wait_for_workers=False,
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now and closes it when it goes
        threads = max(1, torch.get_num_threads() // self.world) if self.backend == "gloo" else None
        for rank in range(1, self.world):
            self.children.append(
                ChildProcess(
                    rank_main,
                    (
                        RankSetup(
                            rank,
                            self.world,
                            store.port,
                            self.backend,
                            self.devices,
                            spec,
                            self.rendezvous_timeout_s,
                            self.collective_timeout_s,
                            threads,
                        ),
                    ),
                    name=f"ssdlocal-tp{rank}",
                    role=f"tensor-parallel rank {rank} ({self.devices[rank]})",
                    error=TensorParallelError,
                    dead_hint="the rank was killed or crashed (out of memory?); rerun, or use fewer target devices",
                    hung_hint="the device may be overloaded or the process stopped; rerun, or use one target device",
                )
            )
        for rank in range(1, self.world):
            self._recv(rank, Reply.JOINING, self.rendezvous_timeout_s)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=0,
                world_size=self.world,
                timeout=timedelta(seconds=self.collective_timeout_s),
            )
        except RuntimeError as exc:  # a rank died or hung while joining
            raise self.failure(f"the tensor-parallel ranks could not join ({_first_line(exc)})") from exc
        self._store = store
        self._watchdog = threading.Thread(target=self._watch, name="ssdlocal-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def procs(self) -> list:
        return [c.proc for c in self.children]

    # ---- messaging
    def _recv(self, rank: int, expect: Reply, limit: float):
        """Wait for one reply of kind `expect` from `rank`; raise on error, death or timeout."""
        try:
            return self.children[rank - 1].recv(expect, limit)
        except BaseException:
            self.broken = True
            raise

    def command_all(self, cmd: Cmd, payload) -> None:
        self._check_usable()
        try:
            for child in self.children:
                child.send(cmd, payload)
        except BaseException:
            self.broken = True
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
                "the tensor-parallel target is "
                + ("closed" if self._closed else "gone after an earlier failure")
                + (f" ({self._dead})" if self._dead else ""),
                "create a new Engine (or rerun) to start the ranks again",
            )
        if self._dead:
            self.broken = True
            raise self.failure("a tensor-parallel rank died")

    # ---- the mirrored forward
    def forward(self, shard, ids, positions, slots, mask, keep=None, graphs=None):
        """One forward on every rank: eager, or through rank 0's GraphCache `graphs`, whose
        primitives are mirrored on the ranks (FORWARD carries the first, STEP the others)."""
        import torch.distributed as dist

        B, T = ids.shape
        S = mask.shape[-1]
        key = ("forward", B, T, S)
        sent = False

        def mirror(action: str, _key) -> None:
            nonlocal sent
            if action == "captured":  # every rank's verdict on the capture just announced
                self._capture_verdicts()
                return
            if sent:
                self.command_all(Cmd.STEP, (action, key))
                return
            self.command_all(Cmd.FORWARD, (B, T, S, key, action))
            dist.broadcast(pack_inputs(ids, positions, slots, mask).to(self.device), 0)  # one collective
            sent = True

        try:
            if graphs is None:
                mirror("eager", key)
                return shard(ids, positions, slots, mask, keep)  # [B, T or n, V]; all_reduce inside
            return graphs.run(
                key, shard, mirror=mirror, input_ids=ids, positions=positions, slots=slots, attn_mask=mask
            )
        except BaseException as exc:
            self.broken = True  # a rank may be waiting in a collective: the group is spent
            mapped = oom_error(exc, f"on {self.device} in the tensor-parallel forward")
            if mapped is not None:
                raise mapped from exc
            if isinstance(exc, RuntimeError):  # gloo/NCCL errors, timeouts (DistBackendError)
                raise self.failure(f"a tensor-parallel collective failed ({_first_line(exc)})") from exc
            raise

    def stalled(self, seconds: float) -> SSDLocalError:
        """A step rank 0 waited `seconds` for on its device without it finishing: a rank is
        hung (not dead: the watchdog sees those) or a device is stuck. The group is spent;
        NCCL is aborted so no collective waits on."""
        self.broken = True
        if self.backend == "nccl":
            _abort_nccl()
        return self.failure(f"a tensor-parallel step did not finish within {seconds:.0f} s")

    def _capture_verdicts(self) -> None:
        """Each rank's answer to the capture just mirrored; CaptureError naming the first
        rank whose capture failed (rank 0's GraphCache then runs that shape eagerly on
        every rank)."""
        from ssdlocal.backends.torch.capture import CaptureError

        verdicts = [self._recv(rank, Reply.CAPTURED, self.collective_timeout_s) for rank in range(1, self.world)]
        failed = [(rank, why) for rank, why in enumerate(verdicts, start=1) if why is not None]
        if failed:
            rank, why = failed[0]
            raise CaptureError(f"on {self.children[rank - 1].role}: {why}")

    def failure(self, what: str) -> SSDLocalError:
        """The best account of why the group failed: a rank's own error, else its exit."""
        time.sleep(0.05)  # a crashing rank's error reply may still be in flight
        for child in self.children:
            found = child.pending_error()
            if found is not None:
                return found
        for child in self.children:
            proc = child.proc
            proc.join(timeout=0.5 if not proc.is_alive() else 0)
            if proc.exitcode is not None:
                return TensorParallelError(
                    f"{what}: {child.role} exited{describe_exit(proc.exitcode)}", child.dead_hint
                )
        return TensorParallelError(
            f"{what}",
            "a rank may be hung or its device overloaded; rerun with --verbose, or use one target device",
        )

    def _watch(self, every_s: float = 0.2) -> None:
        """Notice a dead rank between and during forwards; abort NCCL so rank 0 does not
        sit in a collective until the timeout (gloo fails at once when a peer's socket closes)."""
        while not self._closed:
            for child in self.children:
                proc = child.proc
                if not proc.is_alive() and not self._closed and self._dead is None:
                    self._dead = f"{child.role} exited{describe_exit(proc.exitcode)}"
                    log.warning("%s", self._dead)
                    if self.backend == "nccl":
                        _abort_nccl()
            time.sleep(every_s)

    # ---- shutdown
    def close(self) -> None:
        """Stop every rank and leave the process group; never hangs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for child in self.children:
                child.broken = child.broken or self.broken
                child.close(grace_s=5.0)
        finally:
            _leave_process_group(self.broken)


def loopback_listener():
    """A listening TCP socket on 127.0.0.1 and a free port (for TCPStore's master_listen_fd)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


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

    The LoadedModel's `model` is a TPModel, so TorchRunner drives the whole group.
    """
    from ssdlocal.backends.torch.loader import resolve_checkpoint
    from ssdlocal.backends.torch.models import args_from_config
    from ssdlocal.parallel.tp import check_divisible
    from ssdlocal.weights.formats.checkpoint import load_hf_config

    if not spec.backend.tensor_parallel:
        raise UsageError(
            f"tensor parallelism needs the torch backend, not {spec.backend}",
            "drop --target-devices, or load the checkpoint with the torch backend",
        )
    # converts a .gguf once here (float or quantized), so the ranks find it in the cache
    ckpt = resolve_checkpoint(spec.path, spec.quantization, spec.dtype)
    args = args_from_config(load_hf_config(ckpt))
    check_divisible(args.tensor_parallel_sizes, len(devices))
    group = RankGroup(spec, devices, **timeouts)
    try:
        from ssdlocal.parallel.shard_loader import load_shard

        loaded = load_shard(spec, devices[0], 0, len(devices))
        group.wait_loaded()
        loaded.model = TPModel(loaded.model, group)
        return loaded, group
    except BaseException:
        group.broken = True
        group.close()
        raise


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
