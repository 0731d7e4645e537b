"""How one step is captured and replayed: real CUDA graphs, or their CPU twin, a traced op graph.

Both keep the same contract, which is what makes the CPU twin worth having: a replay
re-runs the recorded kernels on the recorded tensors and never re-runs the Python step.
A tensor the step reads that is not an input is read at the address it had when it was
captured; rebinding the attribute that held it later changes nothing for the replay.
`TracedGraphs` gets this by tracing the step with `make_fx` (every tensor read that is not
an input becomes a constant of the op graph, held by reference, as a CUDA graph holds an
address), so tests on the CPU see the wrong tokens a stale read gives on a GPU.

The graph-pool rule: all graphs of one cache are captured into one memory pool, and a
step's output is a static buffer of that pool. It is valid until the next capture or
replay of the same cache, whatever the shape: the same shape writes the buffer again,
and memory freed when graphs are dropped goes back to the pool that the next capture
allocates from. A caller that keeps an output longer clones it (TorchRunner.forward_raw
does, for the SSD speculator). `TracedGraphs` enforces the rule on the CPU: before each
capture or replay it fills the output it handed out last with NaN (or -1), so an output
held across another call reads as garbage and the exactness tests fail.
Knows nothing about runners or models.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


class CaptureError(RuntimeError):
    """A step could not be captured (it then runs eagerly)."""


@dataclass
class Captured:
    """One captured step: static input buffers, a static output buffer, and its replay."""

    inputs: dict[str, Tensor]  # static buffers the replay reads
    output: Tensor  # static buffer the replay writes
    run: Callable[[], None]  # replays the step over `inputs` into `output`
    nbytes: int = 0  # memory the capture took
    computed: bool = False  # `output` already holds the capturing call's result
    reads: tuple[Tensor, ...] = ()  # tensors read besides the inputs (traced graphs only)
    device: torch.device | None = None  # a CUDA graph's device: replays run inside it
    traced: object | None = None  # the op graph (TracedGraphs only): one node per recorded op

    def replay(self, inputs: dict[str, Tensor]) -> Tensor:
        """Copy `inputs` into the static buffers, replay, return the static output."""
        if self.device is not None and self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: dict[str, Tensor]) -> Tensor:
        for name, value in inputs.items():
            self.inputs[name].copy_(value, non_blocking=True)
        self.run()
        return self.output


class CudaGraphs:
    """Real capture on `device`: warm up and record on one side stream of that device,
    inside `torch.cuda.device(device)`, into one memory pool shared by all its graphs."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None  # created inside the device context
        self._pool = None

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def capture(self, fn: Callable[..., Tensor], inputs: dict[str, Tensor]) -> Captured:
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._pool = torch.cuda.graph_pool_handle()
            return self._capture(fn, inputs, self._stream)

    def _capture(self, fn, inputs, side: torch.cuda.Stream) -> Captured:
        static = {name: t.clone() for name, t in inputs.items()}
        before = torch.cuda.memory_reserved(self.device)
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and library handles settle before recording
                fn(**static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                    output = fn(**static)
        finally:
            # A capture that fails in capture_end can leave the capture stream current.
            torch.cuda.set_stream(current)
        empty = [w for w in caught if "graph is empty" in str(w.message).lower()]
        if empty:  # recorded on another device or stream: a replay would do nothing
            raise CaptureError(f"the captured graph is empty ({str(empty[0].message)[:80]})")
        used = torch.cuda.memory_reserved(self.device) - before
        return Captured(static, output, graph.replay, max(0, used), device=self.device)


class TracedGraphs:
    """The CPU twin of CUDA graphs: capture traces the step into an aten op graph; replay
    runs that graph over the tensors it captured, never the Python step.

    Works on any device (a GPU run can use it to audit the CUDA code path too).
    """

    kind = "trace"

    def __init__(self, free: Callable[[], int | None] = lambda: None) -> None:
        self._free = free
        self._last: Tensor | None = None  # the output handed out by the last capture or replay

    def free_bytes(self) -> int | None:
        return self._free()

    def _poison_last(self) -> None:
        """The graph-pool rule (module docstring): the previous output is no longer valid."""
        if self._last is not None:
            with torch.inference_mode():
                self._last.fill_(float("nan") if self._last.is_floating_point() else -1)
            self._last = None

    def capture(self, fn: Callable[..., Tensor], inputs: dict[str, Tensor]) -> Captured:
        from torch.fx.experimental.proxy_tensor import make_fx

        static = {name: t.clone() for name, t in inputs.items()}
        self._poison_last()  # after the clones: an input may be computed from it
        names = list(static)
        results: list[Tensor] = []

        def flat(*tensors: Tensor) -> Tensor:
            out = fn(**dict(zip(names, tensors)))
            results.append(out)
            return out

        try:
            graph = make_fx(flat, tracing_mode="real")(*static.values())
        except Exception as exc:  # an op or a host read that cannot be traced
            raise CaptureError(f"tracing failed: {type(exc).__name__}: {exc}") from exc
        output = results[-1].detach()  # tracing ran the step on the real tensors
        reads = tuple(
            getattr(graph, node.target)
            for node in graph.graph.nodes
            if node.op == "get_attr" and isinstance(getattr(graph, node.target, None), Tensor)
        )
        values = tuple(static.values())

        def run() -> None:
            self._poison_last()
            output.copy_(graph(*values))
            self._last = output

        self._last = output
        return Captured(static, output, run, output.nbytes, computed=True, reads=reads, traced=graph)


def storage_key(t: Tensor) -> tuple[str, int]:
    """Identifies the memory a tensor lives in (views of one tensor share it)."""
    return (str(t.device), t.untyped_storage().data_ptr())
