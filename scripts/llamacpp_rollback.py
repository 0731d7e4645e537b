"""What keeping a hybrid model's recurrent state right across rejected drafts costs on llama.cpp.

llama.cpp cannot drop the tail of a recurrent sequence (a Gated DeltaNet layer keeps one
state, not one per position), so after a verify of K+1 tokens of which j drafts are
accepted, the state after token j+1 must come from somewhere. Three ways, each measured
per round (one verify of K+1 tokens, a random accepted length, the rollback) on a Qwen3.5
GGUF of random weights written by tests/support/tiny_gguf_families.py:

- `save`: llama_state_seq_get_data with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (the recurrent
  state alone) before the verify; on a rejection set it back, drop the attention cells past
  it and decode the accepted tokens again.
- `copy`: llama_memory_seq_cp of the row into a spare sequence before the verify (llama.cpp
  copies the state when the row next decodes); on a rejection the row becomes that copy
  again and decodes the accepted tokens again.
- `snapshots`: llama.cpp's own per-token snapshots of the last decode (context parameter
  n_rs_seq = K): a rejection is one llama_memory_seq_rm, nothing decoded again.

Each run ends by comparing the last logits with a plain decode of the same tokens (one per
call, in a fresh context): equal up to float rounding for a correct way.

    PYTHONPATH=tests python scripts/llamacpp_rollback.py [--large] [--rounds 40] [--k 4]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np

WAYS = ("save", "copy", "snapshots")


def plain(lib, model, tokens: list[int], threads: int) -> np.ndarray:
    """Last logits of `tokens` decoded one per call after the first (llama.cpp's AR)."""
    ctx = lib.new_context(model, 2048, 512, 1, threads, flash_attn=False)
    vocab = lib.n_vocab(model)
    try:
        out = lib.decode(
            ctx, tokens[:-1], list(range(len(tokens) - 1)), [0] * (len(tokens) - 1), [False] * (len(tokens) - 1), vocab
        )
        out = lib.decode(ctx, tokens[-1:], [len(tokens) - 1], [0], [True], vocab)
        return out[-1]
    finally:
        lib.free_context(ctx)


def run(lib, model, way: str, rounds: int, k: int, threads: int, seed: int) -> dict:
    vocab = lib.n_vocab(model)
    ctx = lib.new_context(model, 2048, 512, 2, threads, flash_attn=False, snapshots=k if way == "snapshots" else 0)
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(64)]
    lib.decode(ctx, prompt, list(range(64)), [0] * 64, [False] * 64, vocab)
    committed = list(prompt)
    saved_bytes = len(lib.seq_state(ctx, 0, partial=True))
    times = {"prepare": 0.0, "verify": 0.0, "rollback": 0.0}
    rejected = redecoded = 0
    for _ in range(rounds):
        feed = [rng.randrange(vocab) for _ in range(k + 1)]  # the bonus token, then K drafts
        start = len(committed)
        t0 = time.perf_counter()
        saved = None
        if way == "save":
            saved = lib.seq_state(ctx, 0, partial=True)
        elif way == "copy":
            lib.seq_rm(ctx, 1, -1, -1)
            lib.seq_cp(ctx, 0, 1, -1, -1)
        t1 = time.perf_counter()
        lib.decode(ctx, feed, list(range(start, start + k + 1)), [0] * (k + 1), [True] * (k + 1), vocab)
        t2 = time.perf_counter()
        j = rng.randrange(k + 1)  # accepted drafts
        kept = feed[: j + 1]
        committed += kept
        if j < k:
            rejected += 1
            if way == "snapshots":
                if not lib.seq_rm(ctx, 0, start + j + 1, -1):
                    raise RuntimeError("llama.cpp refused the snapshot rollback")
            else:
                if way == "save":
                    lib.set_seq_state(ctx, 0, saved, partial=True)
                    lib.seq_rm(ctx, 0, start, -1)
                else:
                    lib.seq_rm(ctx, 0, -1, -1)
                    lib.seq_cp(ctx, 1, 0, -1, -1)
                lib.decode(ctx, kept, list(range(start, start + j + 1)), [0] * (j + 1), [False] * (j + 1), vocab)
                redecoded += j + 1
        t3 = time.perf_counter()
        times["prepare"] += t1 - t0
        times["verify"] += t2 - t1
        times["rollback"] += t3 - t2
    nxt = rng.randrange(vocab)
    last = lib.decode(ctx, [nxt], [len(committed)], [0], [True], vocab)[-1]
    lib.free_context(ctx)
    reference = plain(lib, model, committed + [nxt], threads)
    return {
        "way": way,
        "state_bytes": saved_bytes,
        "ms_per_round": {name: 1e3 * t / rounds for name, t in times.items()},
        "rejected_rounds": rejected,
        "tokens_decoded_again": redecoded,
        "max_logit_diff_vs_plain": float(np.abs(last - reference).max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", action="store_true", help="hidden 2048, 8 layers, 16 value heads of 128x128 states")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from support.tiny_gguf_families import Sizes, write_family_gguf

    from ssdlocal.backends.llamacpp.lib import LlamaLib

    sizes = (
        Sizes(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128, ffn=4096, ssm_k_heads=8, ssm_v_heads=16)
        if args.large
        else Sizes()
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_family_gguf(Path(tmp) / "qwen35.gguf", "qwen35", sizes=sizes)
        lib = LlamaLib(extra_bufts=False)
        model = lib.load_model(str(path), 0, 0)
        print(f"qwen35 {'large' if args.large else 'tiny'}: K={args.k}, {args.rounds} rounds, {args.threads} threads")
        for way in WAYS:
            r = run(lib, model, way, args.rounds, args.k, args.threads, seed=0)
            ms = r["ms_per_round"]
            print(
                f"{way:>9}: state {r['state_bytes'] / 1e6:.3f} MB; per round prepare {ms['prepare']:.2f} ms, "
                f"verify {ms['verify']:.2f} ms, rollback {ms['rollback']:.2f} ms; "
                f"{r['rejected_rounds']} rejections, {r['tokens_decoded_again']} tokens decoded again; "
                f"max |logit - plain| {r['max_logit_diff_vs_plain']:.3g}"
            )
        lib.free_model(model)


if __name__ == "__main__":
    main()
