"""Kernel costs of one quantized projection at small M (the verify shapes), CPU.

For the 1536x8960 (gate/up) and 8960x1536 (down) projections of Qwen2.5-1.5B, times
bf16 `F.linear`, the int8 kernel (`torch._weight_int8pack_mm`), the int4 kernel
(`torch._weight_int4pack_mm_for_cpu`, group 32) and the small-M variants tried for
QuantLinear, for M = 1..16 rows. Variants run interleaved, `--repeats` rounds of
`--inner` calls each; the table shows the median milliseconds per call. "kernel" rows
call torch's op directly, "QuantLinear" rows the module (which splits M = 4q + r rows
into two calls); `--ideas` adds the variants that were tried and rejected.

    python scripts/archive/quant_kernels.py [--threads 2] [--ms 1,2,3,4,5,6,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


from ssdlocal.backends.torch.quant import QuantLinear, quantize


def _tiled_dequant_int8(lin: QuantLinear, tile: int = 512):
    """Idea 1: convert int8 weight tiles to bf16 once per call, one matmul for all M rows."""

    def run(x):
        n = lin.out_features
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for i in range(0, n, tile):
            torch.mm(x, lin.codes[i : i + tile].to(x.dtype).t(), out=out[:, i : i + tile])
        return out.mul_(lin.scales)

    return run


def _split_rows(fn, block: int):
    """Idea 2: run M rows as whole blocks of `block` rows plus single rows."""

    def run(x):
        m = x.shape[0]
        whole = m // block * block
        if whole in (0, m):
            return fn(x)
        return torch.cat([fn(x[:whole]), fn(x[whole:].contiguous())])

    return run


def _pad_rows(fn, block: int):
    """Idea 3: pad M up to a multiple of `block` rows (zeros), keep the first M outputs."""

    def run(x):
        m = x.shape[0]
        extra = -m % block
        if not extra:
            return fn(x)
        return fn(torch.cat([x, x.new_zeros(extra, x.shape[1])]))[:m]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,2,3,4,5,6,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--ideas", action="store_true", help="also time the small-M variants")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    ms = [int(m) for m in opts.ms.split(",")]
    print(f"torch {torch.__version__}, {opts.threads} threads, bf16 activations, median ms per call\n")
    for k, n in ((1536, 8960), (8960, 1536)):
        w = (torch.randn(n, k) * 0.02).bfloat16()
        int8 = QuantLinear(quantize(w, "int8", torch.bfloat16), None, dtype=torch.bfloat16, device="cpu")
        int4 = QuantLinear(quantize(w, "int4", torch.bfloat16), None, dtype=torch.bfloat16, device="cpu")
        variants = {
            "bf16 `F.linear`": lambda x, w=w: F.linear(x, w),
            "int8 kernel": int8._cpu_mm,
            "int8 QuantLinear (split rows)": int8,
            "int4 kernel": int4._cpu_mm,
            "int4 QuantLinear (split rows)": int4,
        }
        if opts.ideas:  # tried and rejected (QuantLinear's split is _split_rows(kernel, 4))
            variants.update(
                {
                    "int8 tiled dequant + bf16 mm": _tiled_dequant_int8(int8),
                    "int4 pad rows to 4": _pad_rows(int4._cpu_mm, 4),
                    "int8 pad rows to 4": _pad_rows(int8._cpu_mm, 4),
                }
            )
        times = {(name, m): [] for name in variants for m in ms}
        inputs = {m: torch.randn(m, k).bfloat16() for m in ms}
        for fn in variants.values():  # warm-up
            for m in ms:
                fn(inputs[m])
        for _ in range(opts.repeats):
            for m in ms:
                for name, fn in variants.items():
                    x = inputs[m]
                    t0 = time.perf_counter()
                    for _ in range(opts.inner):
                        fn(x)
                    times[name, m].append((time.perf_counter() - t0) / opts.inner * 1e3)
        print(f"{k}x{n} (in x out)")
        print("| weights | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        for name in variants:
            cells = " | ".join(f"{statistics.median(times[name, m]):.2f}" for m in ms)
            print(f"| {name} | {cells} |")
        print()


if __name__ == "__main__":
    main()
