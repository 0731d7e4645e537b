"""Copy operations and CPU time of the prefix store on a full, churned store.

The store and KV shapes of Qwen2.5-1.5B (28 layers, 2 kv heads of 128, bf16), a
32,768-token store, 2,048-token calls: each call stores its sequence and takes it back
(`KVPool.save` / `load` through `PrefixIndex` and `runs_of`, as the torch runner does).
Two ways a store fragments: "leaf-first" (whole 2,048-token sequences evicting each other
oldest first: the eviction frees each chain leaf first) and "scattered" (a store full of
one-block sequences, every other one used again, so a new sequence gets every other
pool block). Prints, per call, copy operations (one per slice or indexed copy of one
tensor of one layer) and milliseconds, best of `--repeats` (noisy on a shared machine).

    python scripts/prefix_copies.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


from ssdlocal.backends.prefix import BLOCK_TOKENS, PrefixIndex
from ssdlocal.backends.torch.kvcache import KVCache, KVPool, runs_of

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 28, 2, 128, torch.bfloat16
CALL, STORE = 2048, 32768


class _Counted:
    """Counts tensor copy operations (slice `copy_`, `index_copy_`, `index_select`) while
    on; works on any version of the pool. Off while timing (the wrapper costs time)."""

    on = False
    ops = 0

    @classmethod
    def install(cls) -> None:
        for owner, name in (
            (torch.Tensor, "copy_"),
            (torch.Tensor, "index_copy_"),
            (torch.Tensor, "index_select"),
            (torch, "index_select"),
        ):
            real = getattr(owner, name)

            def wrapped(*a, _real=real, **k):
                if cls.on:
                    cls.ops += 1
                return _real(*a, **k)

            setattr(owner, name, wrapped)


def _timed(fn, pool: KVPool) -> tuple[int, float]:
    _Counted.ops = 0
    t0 = time.perf_counter()
    fn()
    return _Counted.ops, (time.perf_counter() - t0) * 1e3


def _call(index, pool, caches, seq) -> tuple[int, float, int, float, int]:
    """Store `seq` from row 0, then load it back; (store ops, ms, reuse ops, ms, runs)."""
    s_ops, s_ms = _timed(
        lambda: index.insert(
            seq, lambda placed: pool.save(caches, 0, runs_of([(p.index, p.number) for p in placed], BLOCK_TOKENS))
        ),
        pool,
    )
    numbers = index.match(seq)
    runs = runs_of(list(enumerate(numbers)), BLOCK_TOKENS)
    r_ops, r_ms = _timed(lambda: pool.load(caches, 0, runs), pool)
    return s_ops, s_ms, r_ops, r_ms, len(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caches = [KVCache(1, KV_HEADS, CALL, HEAD_DIM, DTYPE, "cpu") for _ in range(LAYERS)]
    for c in caches:
        c.k.normal_(), c.v.normal_()
    _Counted.install()
    for kind in ("leaf-first", "scattered"):
        best: dict[str, float] = {}
        ops = (0, 0)
        for repeat in range(args.repeats + 1):  # the first one counts, the others time
            _Counted.on = repeat == 0
            pool = KVPool([(KV_HEADS, HEAD_DIM)] * LAYERS, STORE, DTYPE, "cpu")
            for k in pool.k + pool.v:
                k.zero_()  # commit the pages: first-touch time is not copy time
            index = PrefixIndex(STORE // BLOCK_TOKENS)
            if kind == "leaf-first":
                for s in range(STORE // CALL + 2):  # fills, then evicts whole sequences
                    seq = [s * 100_000 + i for i in range(CALL)]
                    s_ops, s_ms, r_ops, r_ms, runs = _call(index, pool, caches, seq)
            else:
                singles = [[10_000_000 + i] * BLOCK_TOKENS for i in range(STORE // BLOCK_TOKENS)]
                for seq in singles:
                    index.insert(seq, lambda placed: None)
                for seq in singles[::2]:
                    index.match(seq)
                s_ops, s_ms, r_ops, r_ms, runs = _call(index, pool, caches, list(range(CALL)))
            if repeat == 0:
                ops = (s_ops, r_ops)
                continue
            best["store_ms"] = min(best.get("store_ms", 1e9), s_ms)
            best["reuse_ms"] = min(best.get("reuse_ms", 1e9), r_ms)
        print(
            f"{kind:10s} {CALL} tokens: {runs} runs; store {ops[0]} copy ops {best['store_ms']:.1f} ms; "
            f"reuse {ops[1]} copy ops {best['reuse_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
