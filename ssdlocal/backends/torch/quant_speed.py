"""Whether int8 / int4 weights pay on this GPU: their kernels timed against the dense
matmul at a model's step shapes, before its weights load.

Quantized weights halve or quarter the bytes a decode step reads, but only a kernel that
streams them at the memory's speed turns that into time: torch's int8 CUDA kernel
(`_weight_int8pack_mm`) gives each output one thread looping over K in float32, and is
reported several times behind a bfloat16 GEMV. So before a CUDA model loads with int8 or
int4 weights, its largest projections (the MLP's gate/up and down) are timed with random
weights, quantized through the kernel the model would run and dense in its dtype, at the
rows of a decode step and a K+1 verify (STEP_ROWS); where the quantized kernel is slower
at any of them and the dense weights fit in the GPU's free memory, the quantization is
refused with the numbers and a hint (a slower kernel that saves memory the model needs is
kept, with a warning). Timings are kept per GPU, torch, kernel and shapes
(core/measured.py), so a machine measures once. Knows nothing about rows or rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ssdlocal.core.errors import UsageError
from ssdlocal.core.measured import MeasuredStore, positive_seconds
from ssdlocal.core.quantization import Quantization

log = logging.getLogger(__name__)

STEP_ROWS = (1, 5)  # a batch-1 decode step and a K=4 verify: the rows every projection multiplies
REPEATS = 20
FIT_MARGIN = 1.2  # dense weights "fit" when free memory holds them with this margin (KV cache, activations)
MIN_DENSE_BYTES = 64 << 20  # smaller models are not timed: their steps are bound by launches, not weights

Timer = Callable[[Callable[[], object], torch.device], float]  # seconds of one call


@dataclass(frozen=True)
class QuantSpeed:
    """Seconds of the timed projections per step rows: quantized kernel and dense."""

    scheme: Quantization
    kernel: str
    rows: tuple[int, ...]
    quantized_s: tuple[float, ...]
    dense_s: tuple[float, ...]
    where: str  # the GPU's name

    @property
    def pays(self) -> bool:
        """No slower than the dense matmul at any of the step rows."""
        return all(q <= d for q, d in zip(self.quantized_s, self.dense_s))

    def describe(self) -> str:
        times = ", ".join(
            f"{q * 1e3:.3f} vs {d * 1e3:.3f} ms at {m} row{'s' * (m > 1)}"
            for m, q, d in zip(self.rows, self.quantized_s, self.dense_s)
        )
        return f"{self.scheme} ({self.kernel}) against dense on {self.where}: {times}"


def step_shapes(args) -> list[tuple[int, int]]:
    """(out, in) of the projections timed: the MLP's gate/up and down (most of a step's bytes)."""
    return [(args.intermediate_size, args.hidden_size), (args.hidden_size, args.intermediate_size)]


def dense_bytes(args, dtype: torch.dtype) -> int:
    """The model's weights dense in `dtype` (from its config: no file read)."""
    h, d = args.hidden_size, args.head_dim
    attention = h * d * (2 * args.num_heads + 2 * args.num_kv_heads)
    per_layer = attention + 3 * h * args.intermediate_size
    embeddings = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    return (args.num_layers * per_layer + embeddings) * torch.empty((), dtype=dtype).element_size()


def check_quant_speed(
    args, scheme: Quantization, device: torch.device, dtype: torch.dtype, timer: Timer | None = None
) -> None:
    """Refuse int8/int4 weights on a CUDA `device` whose kernel is slower than the dense
    matmul at the step shapes, when the dense weights would fit (UsageError with the
    timings and a hint); nothing on other devices, for scheme "none", or for a model under
    MIN_DENSE_BYTES dense (its steps are bound by launches: the kernel's speed is noise there)."""
    if device.type != "cuda" or scheme == Quantization.NONE or dense_bytes(args, dtype) < MIN_DENSE_BYTES:
        return
    speed = measured_speed(args, scheme, device, dtype, timer)
    if speed.pays:
        log.info("quantized weights pay: %s", speed.describe())
        return
    from ssdlocal.backends.torch.kvcache import free_bytes

    free, need = free_bytes(device), dense_bytes(args, dtype)
    if free is not None and need * FIT_MARGIN > free:
        log.warning(
            "%s weights run slower than dense, kept because dense ones would not fit: %s", scheme, speed.describe()
        )
        return
    other = Quantization.INT4 if scheme == Quantization.INT8 else Quantization.INT8
    raise UsageError(
        f"{scheme} weights would run slower than {str(dtype).removeprefix('torch.')} ones here, measured "
        f"{speed.describe()}",
        f"use --quantization none (the dense weights fit on {device}) or --quantization {other}",
    )


def measured_speed(
    args, scheme: Quantization, device: torch.device, dtype: torch.dtype, timer: Timer | None = None
) -> QuantSpeed:
    """The step shapes' timings kept for this GPU, torch and kernel, else timed now (and kept)."""
    from ssdlocal.backends.torch.quant import kernel_for

    kernel = kernel_for(scheme, device, dtype)  # refuses what the GPU cannot run at all
    where = torch.cuda.get_device_name(device) if timer is None else str(device)
    shapes = step_shapes(args)
    key = {"kernel": kernel, "dtype": str(dtype), "gpu": where, "shapes": shapes, "rows": list(STEP_ROWS)}
    store = _store() if timer is None else None
    found = store.get("quant-speed", key, lambda v: positive_seconds(v, 2 * len(STEP_ROWS))) if store else None
    if found is not None:
        n = len(STEP_ROWS)
        return QuantSpeed(scheme, kernel, STEP_ROWS, tuple(found[:n]), tuple(found[n:]), where)
    speed = time_projections(shapes, scheme, kernel, device, dtype, timer or _cuda_seconds, where)
    if store is not None:
        store.put("quant-speed", key, [*speed.quantized_s, *speed.dense_s])
    return speed


def time_projections(
    shapes: Sequence[tuple[int, int]], scheme: Quantization, kernel: str, device, dtype, timer: Timer, where: str
) -> QuantSpeed:
    """Seconds of the projections of `shapes` at each of STEP_ROWS: QuantLinears of random
    weights through `kernel`, and the same weights dense in `dtype`."""
    from ssdlocal.backends.torch.quant import QuantLinear, quantize

    gen = torch.Generator().manual_seed(0)
    quantized, dense = [], []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * k**-0.5  # [N, K]
        quantized.append(QuantLinear(quantize(w, scheme, dtype), None, dtype=dtype, device=device))
        dense.append(w.to(device=device, dtype=dtype))
    q_s, d_s = [], []
    with torch.inference_mode():
        for m in STEP_ROWS:
            xs = [torch.randn(m, k, generator=gen).to(device=device, dtype=dtype) for _, k in shapes]  # [M, K] each
            q_s.append(timer(lambda: [lin(x) for lin, x in zip(quantized, xs)], device))
            d_s.append(timer(lambda: [x @ w.t() for w, x in zip(dense, xs)], device))
    return QuantSpeed(scheme, kernel, STEP_ROWS, tuple(q_s), tuple(d_s), where)


def _cuda_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of `fn` on `device` (CUDA events; the load may wait for the device)."""
    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        times = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _store() -> MeasuredStore | None:
    try:
        return MeasuredStore()
    except Exception:  # noqa: BLE001 - an unusable cache folder only costs measuring
        return None
