"""What a hybrid model's linear-attention states cost (docs/architecture.md §12c): bytes of
one row's state after one position, what a verify of K+1 tokens writes, an SSD tree's
branch buffers, and the time of the copies a tree branch and the prefix store add
(`LinearStates.adopt`: a taken branch's state into the row's ring; one tree step's
branch states; `StatePool.put`: a block-end state into the prefix store), for the test
suite's tiny Qwen3.5 and a Qwen3.5-9B-like shape (24 Gated DeltaNet layers, 16 key and 32
value heads of 128, kernel 4, bf16 weights; recurrent states are float32), on this
machine's device.

    python scripts/hybrid_state_costs.py [--branches 4] [--k 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from ssdlocal.backends.torch.linear_states import LinearStates
from ssdlocal.backends.torch.stored_states import StatePool

SHAPES = {  # per linear layer: (conv channels, value heads, key width, value width)
    "tiny (tests: 3 linear layers)": ([(2 * 2 * 8 + 4 * 8, 4, 8, 8)] * 3, torch.float32),
    "Qwen3.5-9B-like (24 linear layers)": ([(2 * 16 * 128 + 32 * 128, 32, 128, 128)] * 24, torch.bfloat16),
}


def timed(fn, device, n: int = 20) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--branches", type=int, default=4, help="tree branches per row")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    for name, (shapes, dtype) in SHAPES.items():
        per = LinearStates.state_bytes(shapes, 4, dtype)
        states = LinearStates(1, shapes, 8, 4, dtype, device)
        states.tree_width(args.branches)
        tree = sum(t.nbytes for bufs in (*states.tree_rec, *states.tree_conv) for t in bufs)
        branch = torch.tensor([1], device=device)
        adopt = timed(lambda i=0: states.adopt(0, 1, branch, 40 + i), device)
        W = args.branches

        def step_write(i=0):
            for layer in range(len(shapes)):
                states.tree_rec[layer][1][:, :W].copy_(states.tree_rec[layer][0][:, :W])

        write = timed(step_write, device)
        pool = StatePool(2, shapes, 4, dtype, device)
        window, rec = states.block_state(0, 47)
        put = timed(lambda i=0: pool.put(i % 2, ("block", i), window, rec), device)
        print(
            f"{name}: {per / 2**20:.3f} MiB per state; a verify of {args.k + 1} tokens writes "
            f"{(args.k + 1) * per / 2**20:.2f} MiB; tree buffers for {W} branches (two, read/write) "
            f"{tree / 2**20:.1f} MiB per row; take_branch {adopt * 1e3:.2f} ms; one tree step's "
            f"{W} branch states {write * 1e3:.2f} ms; prefix-store put {put * 1e3:.2f} ms ({device})"
        )


if __name__ == "__main__":
    main()
