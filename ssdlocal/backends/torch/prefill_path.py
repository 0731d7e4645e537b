"""How a long prompt is read on this machine: quantized kernels, or weights expanded to
dense matrices in the activation dtype or float32 - chosen from timings taken once per
process, never assumed from the instruction set.

torch's CPU int4/int8 kernels work on blocks of 4 rows and unpack the weights again for
every block, so for hundreds of rows a dense matmul is faster where the CPU multiplies
bfloat16 natively (AVX-512-BF16, AMX: 2.9x at 512 rows on a 2-core EPYC). Where it does
not (AVX2), oneDNN's bfloat16 matmul is 2.3x slower than the int4 kernel there, and a
float32 matmul 1.6x faster. So the first long feed times one of the model's quantized
linears (its largest in the first layer) three ways - the kernel; expanded to the
activation dtype; expanded to float32 - at up to 256 rows, with the expansion's own time,
and each feed then takes the cheapest for its row count: expansion once per layer plus
rows x the dense time per row, against rows x the kernel's time per row. The timings are
kept in the cache's measurements (core/measured.py) by machine, threads and linear shape,
so only the first process on a machine pays for them. Knows nothing about prompts or rows
beyond counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssdlocal.backends.torch.int4_cpu import capability
from ssdlocal.backends.torch.quant import QuantLinear
from ssdlocal.core.measured import MeasuredStore, positive_seconds

PROBE_ROWS = 256


@dataclass(frozen=True)
class PathCosts:
    """Seconds for one linear: per row through the kernel; per row dense, and the expansion,
    per dense dtype."""

    kernel_per_row: float
    dense: dict[torch.dtype, tuple[float, float]]  # dtype -> (per row, expansion)

    def best(self, rows: int) -> torch.dtype | None:
        """The dense dtype that reads `rows` rows fastest, or None (the kernel)."""
        choice, cost = None, rows * self.kernel_per_row
        for dtype, (per_row, expansion) in self.dense.items():
            if expansion + rows * per_row < cost:
                choice, cost = dtype, expansion + rows * per_row
        return choice


def dense_dtype(model, rows: int) -> torch.dtype | None:
    """The dtype a feed of `rows` rows (batch x tokens) should expand `model`'s quantized
    weights to, or None to keep the quantized kernels (also when nothing in the first layer
    can expand: not quantized, or a CUDA int4 layout whose read-back failed its check). On a
    GPU, expandable weights (int8, tinygemm int4) go to the activation dtype unmeasured: its
    dense matmul is the fast path for many rows."""
    linear = _probe_linear(model)
    if linear is None:
        return None
    if next(linear.buffers()).device.type != "cpu":
        return linear.dtype  # a GPU's dense matmul (cuBLAS) is its fast path for many rows
    key = (linear.kernel, linear.in_features, linear.out_features, linear.dtype, capability(), torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = _kept(linear, key)
    return _MEASURED[key].best(rows)


def _probe_linear(model) -> QuantLinear | None:
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    found = [m for m in layers[0].modules() if isinstance(m, QuantLinear) and m.expandable]
    return max(found, key=lambda m: m.in_features * m.out_features) if found else None


_MEASURED: dict[tuple, PathCosts] = {}  # by (kernel, in, out, dtype, ISA, threads): once per process


def _kept(linear: QuantLinear, key: tuple) -> PathCosts:
    """The timings kept for this machine and linear, else measured now and kept."""
    try:
        store = MeasuredStore()
    except Exception:  # noqa: BLE001 - an unusable cache folder only costs measuring
        store = None
    dtypes = list(dict.fromkeys((linear.dtype, torch.float32)))
    shape = {"linear": [str(k) for k in key[:4]], "isa": key[4], "dense": [str(d) for d in dtypes]}
    found = store.get("prefill-path", shape, lambda v: positive_seconds(v, 1 + 2 * len(dtypes))) if store else None
    if found is not None:
        return PathCosts(found[0], {d: (found[1 + 2 * i], found[2 + 2 * i]) for i, d in enumerate(dtypes)})
    costs = _measure(linear)
    if store is not None:
        store.put("prefill-path", shape, [costs.kernel_per_row, *(x for d in dtypes for x in costs.dense[d])])
    return costs


def _measure(linear: QuantLinear) -> PathCosts:
    """Timings of `linear` (best of 2 after a warm-up) at PROBE_ROWS rows."""
    k, dtype = linear.in_features, linear.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, generator=gen).to(dtype)  # [M, K]
    kernel_s = _best(lambda: linear(x))
    dense: dict[torch.dtype, tuple[float, float]] = {}
    for target in dict.fromkeys((dtype, torch.float32)):
        expand_s = _best(lambda: _expand_once(linear, target))
        with linear.expanded(dtype=target):
            dense[target] = (_best(lambda: linear(x)) / PROBE_ROWS, expand_s)
    return PathCosts(kernel_s / PROBE_ROWS, dense)


def _expand_once(linear: QuantLinear, dtype: torch.dtype) -> None:
    with linear.expanded(dtype=dtype):
        pass


@torch.inference_mode()
def _best(fn, repeats: int = 2) -> float:
    fn()  # warm-up: first-touch pages, kernel dispatch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
