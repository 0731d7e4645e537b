"""The channel that carries the draft's q [B, K, V] from the SSD worker to target rank 0.

Two kinds, chosen by `choose_q_channel` from the two devices:
- "cuda-ipc": a buffer on the target's GPU, handed to the worker as a CUDA tensor
  (torch.multiprocessing pickles it as an IPC handle). The worker copies q GPU -> GPU
  (peer-to-peer when the GPUs allow it) and synchronizes before it replies; no host
  round trip.
- "shm": a shared-memory CPU tensor (the CPU path, and any placement with a CPU side).
Only a draft model sends q (other drafts propose point masses); "none" is the kind a
caller may use for no channel. Selection is pure (testable on CPU); buffers are made with
`make_q_channel`. Knows nothing about the engine or pipes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ssdlocal.core.errors import UsageError

KINDS = ("cuda-ipc", "shm", "none")


@dataclass(frozen=True)
class ChannelChoice:
    kind: str  # one of KINDS
    reason: str  # one line for logs and `ssdlocal devices`


def _is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def choose_q_channel(
    target_device: str,
    draft_device: str,
    *,
    platform: str | None = None,
    cuda_available: bool | None = None,
    force: str | None = None,
) -> ChannelChoice:
    """Pick the q channel for a target on `target_device` and a draft on `draft_device`.

    `force` ("cuda-ipc" | "shm") overrides, and is refused where it cannot work.
    `platform` / `cuda_available` default to this machine (tests pass them).
    """
    platform = sys.platform if platform is None else platform
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    both_cuda = _is_cuda(target_device) and _is_cuda(draft_device)
    ipc_ok = both_cuda and cuda_available and platform.startswith("linux")
    if force is not None:
        if force not in ("cuda-ipc", "shm"):
            raise UsageError(f"unknown q channel {force!r}", "choose cuda-ipc or shm")
        if force == "cuda-ipc" and not ipc_ok:
            raise UsageError(
                f"the cuda-ipc channel needs target and draft on CUDA devices under Linux "
                f"(target {target_device}, draft {draft_device})",
                "drop the override: the shared-memory channel is chosen automatically",
            )
        return ChannelChoice(force, "forced")
    if ipc_ok:
        same = target_device == draft_device
        return ChannelChoice(
            "cuda-ipc",
            f"target {target_device} and draft {draft_device} are CUDA devices: q stays on the "
            + ("GPU (same device)" if same else "GPUs (device-to-device copy)"),
        )
    if both_cuda and not platform.startswith("linux"):
        return ChannelChoice("shm", f"CUDA IPC is not supported on {platform}: q goes through host memory")
    if both_cuda:
        return ChannelChoice("shm", "CUDA is not available in this process: host shared memory")
    return ChannelChoice("shm", "a CPU side: host shared memory")


class QChannel:
    """A q buffer [B, K, V] float32 both processes see. Send `buffer` to the worker once
    (StartMsg.q_buffer); the worker calls `write_q(buffer, q)`; the target calls `read`."""

    def __init__(self, kind: str, batch: int, k: int, vocab: int, device: str = "cpu") -> None:
        self.kind = kind
        if kind == "cuda-ipc":
            self.buffer = torch.zeros(batch, k, vocab, device=device)  # [B, K, V] on target GPU
        elif kind == "shm":
            self.buffer = torch.zeros(batch, k, vocab).share_memory_()  # [B, K, V] host
        else:
            raise ValueError(f"no buffer for channel kind {kind!r}")

    def read(self, device: str | torch.device | None = None) -> torch.Tensor:
        """A private copy of q [B, K, V] on `device` (default: where the buffer lives)."""
        q = self.buffer.clone()  # [B, K, V]; the worker may overwrite the buffer next round
        return q if device is None else q.to(device)


def make_q_channel(
    choice: ChannelChoice, batch: int, k: int, vocab: int, target_device: str = "cpu"
) -> QChannel | None:
    if choice.kind == "none":
        return None
    return QChannel(choice.kind, batch, k, vocab, target_device if choice.kind == "cuda-ipc" else "cpu")


def write_q(buffer: torch.Tensor, q: torch.Tensor) -> None:
    """Worker side: put q [n, K, V] into the shared buffer, visible to the target on return.

    For CUDA buffers the copy is asynchronous, so wait for both devices before the
    worker sends its PROPOSAL message (the message is the only synchronization).
    """
    buffer[: q.shape[0]].copy_(q)  # [n, K, V]
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)
        if q.is_cuda and q.device != buffer.device:
            torch.cuda.synchronize(q.device)
