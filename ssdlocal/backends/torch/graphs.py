"""Captured forwards: one CUDA graph per input shape, replayed with static buffers.

A decode step of a small model is bound by kernel launches, not by memory: capturing the
whole forward once per shape and replaying it removes that cost (the nano-vllm pattern:
static input and output buffers, one shared memory pool). `GraphCache.run` captures a
shape on first use with the call's own inputs (so the capture's side effects on the KV
cache are exactly the step's), replays it afterwards, and runs eagerly where capture is
refused (memory budget, failure). The capture mechanism is a small backend object, so the
bookkeeping is tested on the CPU with `EmulatedGraphs` (same buffers, replay = call again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tree widths are padded up to one of these


def bucket(width: int) -> int:
    """The smallest bucket >= width (widths past the last bucket are their own bucket)."""
    return next((b for b in BUCKETS if b >= width), width)


@dataclass
class Captured:
    inputs: dict[str, Tensor]  # static buffers the replay reads
    output: Tensor  # static buffer the replay writes
    replay: Callable[[], None]
    nbytes: int = 0  # memory the capture took
    computed: bool = False  # `output` already holds the capturing call's result


class CudaGraphs:
    """Real capture: warm up on a side stream, then record into a shared memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def capture(self, fn: Callable[..., Tensor], inputs: dict[str, Tensor]) -> Captured:
        static = {name: t.clone() for name, t in inputs.items()}
        before = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and library handles settle before recording
                fn(**static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn(**static)
        used = torch.cuda.memory_reserved(self.device) - before
        return Captured(static, output, graph.replay, max(0, used))


class EmulatedGraphs:
    """The captured code path without CUDA: static buffers, replay re-runs the function."""

    def __init__(self, free: Callable[[], int | None] = lambda: None) -> None:
        self._free = free

    def free_bytes(self) -> int | None:
        return self._free()

    def capture(self, fn: Callable[..., Tensor], inputs: dict[str, Tensor]) -> Captured:
        static = {name: t.clone() for name, t in inputs.items()}
        output = fn(**static)

        def replay() -> None:
            output.copy_(fn(**static))

        return Captured(static, output, replay, output.numel() * output.element_size(), True)


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    eager: int = 0  # calls that ran eagerly (refused or failed shapes)
    refused: list[str] = field(default_factory=list)


class GraphCache:
    """Captured step functions keyed by shape, within a memory budget.

    `reserve_bytes`: capture is refused when the device would have less free memory than
    this afterwards (what the KV cache and activations of eager work still need).
    """

    def __init__(self, backend, *, reserve_bytes: int = 1 << 30, max_graphs: int = 64) -> None:
        self.backend = backend
        self.reserve_bytes = reserve_bytes
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, Captured] = {}
        self._refused: set[Hashable] = set()
        self.stats = GraphStats()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[..., Tensor], **inputs: Tensor) -> Tensor:
        """fn(**inputs), replayed from a capture when one exists or can be made.

        The returned tensor is a static buffer: read it before the next call with `key`.
        """
        captured = self._graphs.get(key)
        if captured is None and key not in self._refused:
            captured = self._capture(key, fn, inputs)
            if captured is not None:
                return captured.output  # the capture ran this very step (same inputs)
        if captured is None:
            self.stats.eager += 1
            return fn(**inputs)
        for name, value in inputs.items():
            captured.inputs[name].copy_(value, non_blocking=True)
        captured.replay()
        self.stats.replays += 1
        return captured.output

    def _capture(self, key, fn, inputs) -> Captured | None:
        free = self.backend.free_bytes()
        if len(self._graphs) >= self.max_graphs or (free is not None and free < self.reserve_bytes):
            return self._refuse(key, "memory budget")
        try:
            captured = self.backend.capture(fn, inputs)
        except RuntimeError as exc:  # an op that cannot be captured: stay eager for this shape
            log.debug("graph capture of %s failed: %s", key, exc)
            return self._refuse(key, f"capture failed ({str(exc).splitlines()[0][:80]})")
        if not captured.computed:
            captured.replay()  # recording does not run the step; the replay does
        self._graphs[key] = captured
        self.stats.captured += 1
        return captured

    def _refuse(self, key, why: str) -> None:
        self._refused.add(key)
        self.stats.refused.append(f"{key}: {why}")
        return None

    def clear(self) -> None:
        """Forget every capture (the buffers they read, e.g. the KV cache, are gone)."""
        self._graphs.clear()
        self._refused.clear()


def make_graph_cache(device: torch.device, mode: str) -> GraphCache | None:
    """`mode`: "auto" (CUDA graphs on CUDA devices, none elsewhere), "off", "emulate"."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "emulate" or device.type != "cuda":
        return GraphCache(EmulatedGraphs())
    return GraphCache(CudaGraphs(device))
