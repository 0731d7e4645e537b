"""Ranks 1..N-1 of a tensor-parallel target: the process entry point, the handler that
mirrors rank 0's forwards, and the pipe protocol both sides speak (Cmd / Reply).

A rank loads its shard, then answers rank 0 through ssdlocal.ipc's serve loop (which
also notices a dead parent): CACHE allocates its KV cache; FORWARD joins rank 0's input
broadcast and runs the same forward (eagerly, or capturing or replaying the graph of
the key rank 0 names, see RankGraphs), so every all_reduce meets its partners; a capture
answers whether it worked (CAPTURED), so a shape one rank cannot capture runs eagerly on
every rank, as on rank 0, instead of ending the group; PREFIX_* keep the rank's share of
the prefix cache in step with rank 0's. Any other failure reaches rank 0 as an error reply
before the process exits non-zero.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch

from ssdlocal.core.config import GraphMode, ModelSpec


class Cmd(IntEnum):
    """Rank 0 -> other ranks (pipe)."""

    CACHE = 1  # (batch_size, num_slots): allocate the rank's KV cache
    FORWARD = 2  # (B, T, S, key, action): join the input broadcast, then run `action` on it
    PREFIX_POOL = 3  # tokens: allocate the rank's prefix cache (ACK)
    PREFIX_SAVE = 4  # (row, runs): cache -> prefix cache (no reply)
    PREFIX_LOAD = 5  # (row, runs): prefix cache -> cache (no reply)
    GRAPHS = 6  # graph mode (core.config.GraphMode): how this rank captures steps (ACK)
    STEP = 7  # (action, key): one more primitive on the last FORWARD's inputs (no reply)
    LINEAR_ENTER = 8  # (ends, tree): the forwards until LINEAR_LEAVE run the linear layers so (no reply)
    LINEAR_LEAVE = 9  # None: back to per-position linear layers (no reply)
    RING = 10  # positions: grow the linear layers' rings (no reply)
    FORGET = 11  # None: no row holds a linear-attention state any more (no reply)
    DROP = 12  # key: let the graph of that key go (rank 0 evicted or refused it; no reply)


class Reply(IntEnum):
    """Other ranks -> rank 0 (pipe)."""

    JOINING = 1  # about to join the process group
    LOADED = 2  # shard loaded (payload: bytes of parameters held)
    ACK = 3  # cache allocated
    CAPTURED = 4  # after a capture: None, or why it failed (rank 0 then runs that shape eagerly)


def packed_size(B: int, T: int, S: int) -> int:
    """int64 words of pack_inputs' result: 3*B*T for ids/positions/slots, the mask bytes / 8."""
    return 3 * B * T + -(-(B * T * S) // 8)


def pack_inputs(ids, positions, slots, mask):
    """ids/positions/slots [B, T] long + mask [B, T, S] bool -> one flat int64 tensor, so a
    forward costs one broadcast; the mask travels as bytes (8 per word), not as int64."""
    B, T, S = mask.shape
    mask8 = mask.reshape(-1).to(torch.uint8)  # [B*T*S]
    pad = packed_size(B, T, S) * 8 - 3 * B * T * 8 - mask8.numel()
    if pad:
        mask8 = torch.cat((mask8, mask8.new_zeros(pad)))  # [8 * words]
    head = torch.stack((ids, positions, slots)).reshape(-1).to(torch.long)  # [3*B*T]
    return torch.cat((head, mask8.view(torch.long)))  # [packed_size]


def unpack_inputs(packed, B: int, T: int, S: int):
    """Inverse of pack_inputs: (ids, positions, slots [B, T] long, mask [B, T, S] bool)."""
    head = packed[: 3 * B * T].view(3, B, T)  # [3, B, T]
    mask = packed[3 * B * T :].view(torch.uint8)[: B * T * S].view(B, T, S).bool()  # [B, T, S]
    return head[0], head[1], head[2], mask


class RankGraphs:
    """A rank's captured forwards, one per key, driven by rank 0's GraphCache: this side
    never decides, it runs the primitive rank 0 announces (graphs.GraphCache's `mirror`),
    so both sides capture, replay and fall back to eager together."""

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.backend = None  # capture.CudaGraphs / TracedGraphs (use)
        self.captured: dict = {}

    def use(self, mode: GraphMode) -> None:
        from ssdlocal.backends.torch.graphs import capture_backend

        self.clear()
        self.backend = capture_backend(self.device, mode)

    def clear(self) -> None:
        self.captured.clear()

    def run(self, action: str, key, inputs: dict) -> str | None:
        """`action` ("eager", "capture", "replay") on `inputs` (input_ids, positions,
        slots, attn_mask). A capture returns None, or why it failed: it leaves no graph
        (rank 0 refuses the shape for every rank, tells the ranks to drop it, DROP, and runs
        it eagerly); a later replay of a key this rank has no graph for raises (rank 0 gets
        the error)."""
        if action == "eager":
            self.model(**inputs)
        elif action == "capture":
            self.captured.pop(key, None)
            if self.backend is None:
                raise RuntimeError("rank 0 captures a step but this rank has no graph mode")
            try:
                self.captured[key] = self.backend.capture(self.model, inputs)
            except Exception as exc:  # noqa: BLE001 - told to rank 0, which falls back for every rank
                return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        elif action == "replay":
            found = self.captured.get(key)
            if found is None:
                raise RuntimeError(f"rank 0 replays step {key}, which this rank did not capture")
            found.replay(inputs)
        else:
            raise RuntimeError(f"unknown step action {action!r}")
        return None


def pin_to_loopback(backend: str) -> None:
    """Single-machine groups bootstrap over loopback only (children inherit the setting)."""
    if not sys.platform.startswith("linux"):
        return
    os.environ.setdefault("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", "lo")


@dataclass(frozen=True)
class RankSetup:
    """What rank `rank` >= 1 starts with (RankGroup makes one a rank)."""

    rank: int
    world: int
    port: int  # rank 0's TCPStore
    backend: str  # the process group's: "nccl" or "gloo"
    devices: Sequence[str]  # every rank's, by rank
    spec: ModelSpec  # the target's (parallel.shard_loader.load_shard)
    rendezvous_timeout_s: float
    collective_timeout_s: float
    threads: int | None  # torch's intra-op threads (None: leave torch's choice)


def rank_main(conn, parent_pid, pdeathsig, setup: RankSetup) -> None:
    """Process entry point of rank `setup.rank` >= 1 (spawned by RankGroup through ipc)."""
    from ssdlocal.ipc.serve import run_child

    run_child(
        conn,
        parent_pid,
        pdeathsig,
        lambda: _serve(conn, parent_pid, setup),
        role=f"tensor-parallel rank {setup.rank} ({setup.devices[setup.rank]})",
        default_kind="TensorParallelError",
        prefix_errors=True,
    )


def _serve(conn, parent_pid, setup: RankSetup) -> None:
    rank, world, backend, devices = setup.rank, setup.world, setup.backend, setup.devices
    import torch.distributed as dist

    from ssdlocal.core.memory import keep_freed_memory
    from ssdlocal.ipc.serve import serve

    keep_freed_memory()
    if setup.threads:
        torch.set_num_threads(setup.threads)
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pin_to_loopback(backend)  # inherited from rank 0 already
    conn.send((Reply.JOINING, None))
    store = dist.TCPStore(
        "127.0.0.1", setup.port, world, is_master=False, timeout=timedelta(seconds=setup.rendezvous_timeout_s)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=setup.collective_timeout_s)
    )
    from ssdlocal.parallel.shard_loader import load_shard
    from ssdlocal.parallel.tp import shard_bytes

    loaded = load_shard(setup.spec, devices[rank], rank, world, tokenizer=False)
    model = loaded.model
    model.lm_head = torch.nn.Identity()  # only rank 0 needs logits: skip the [hidden, V] matmul
    conn.send((Reply.LOADED, shard_bytes(model)))

    graphs = RankGraphs(model, device)
    inputs: dict = {}  # the last FORWARD's inputs, which STEP commands run again
    linear = ExitStack()  # a hybrid model's linear-layer context (LINEAR_ENTER .. LINEAR_LEAVE)

    def step(action: str, key) -> None:
        failed = graphs.run(action, key, inputs)
        if action == "capture":
            conn.send((Reply.CAPTURED, failed))

    def handle(cmd, payload) -> None:
        if cmd == Cmd.FORWARD:
            B, T, S, key, action = payload
            packed = torch.empty(packed_size(B, T, S), dtype=torch.long, device=device)
            dist.broadcast(packed, 0)
            inputs.clear()
            ids, positions, slots, mask = unpack_inputs(packed, B, T, S)
            inputs.update(input_ids=ids, positions=positions, slots=slots, attn_mask=mask)  # the forward's keywords
            step(action, key)  # output unused: rank 0 has the logits
        elif cmd == Cmd.STEP:
            step(*payload)
        elif cmd == Cmd.DROP:
            graphs.captured.pop(payload, None)
        elif cmd == Cmd.GRAPHS:
            graphs.use(payload)
            conn.send((Reply.ACK, None))
        elif cmd == Cmd.CACHE:
            batch_size, num_slots = payload
            model.setup_cache(batch_size, num_slots, loaded.dtype, device)
            graphs.clear()  # they read the old cache
            conn.send((Reply.ACK, None))
        elif cmd == Cmd.PREFIX_POOL:
            model.setup_prefix_pool(payload, loaded.dtype, device)
            conn.send((Reply.ACK, None))
        elif cmd in (Cmd.PREFIX_SAVE, Cmd.PREFIX_LOAD):
            row, runs = payload
            (model.save_prefix if cmd == Cmd.PREFIX_SAVE else model.load_prefix)(row, runs)
        elif cmd == Cmd.LINEAR_ENTER:  # hybrid models (backends/torch/models/hybrid.py)
            linear.enter_context(model.context(*payload))
        elif cmd == Cmd.LINEAR_LEAVE:
            linear.close()
        elif cmd == Cmd.RING:
            model.grow_ring(payload)
        elif cmd == Cmd.FORGET:
            model.forget_states()
        else:
            raise RuntimeError(f"unknown command {cmd!r}")

    with torch.inference_mode():
        if serve(conn, parent_pid, handle) == "shutdown":
            dist.destroy_process_group()
