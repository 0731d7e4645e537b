"""Cold prefill, ours vs llama.cpp: one chat prompt over a source file read by each, in turn.

    python scripts/prefill_race.py [--gguf FILE] [--repeats 2] [--threads 2] [--systems ours,llamacpp]

Both read the same GGUF and the same token ids (the built-in target by default; a system
message holding the first 220 lines of a source file and one question, about 2,160
tokens), with no prefix reuse: ours is `Engine.generate(max_new_tokens=1)` on the torch
backend (the first token's time is the prefill), llama.cpp is llama-cpp-python's
`Llama.eval` after a `reset` (`n_batch` 512). The repeats alternate between the two in one
process each. Prints prompt tokens per second per repeat and, for ours, the timings from
which the prefill path was chosen (kernel vs dense per row, expansion per layer). Set
`ATEN_CPU_CAPABILITY=avx2` (and `ONEDNN_MAX_CPU_ISA=AVX2`) to read as an AVX2-only CPU does.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "ssdlocal" / "server" / "scheduler.py"


def main() -> int:
    import torch

    from ssdlocal.core.config import EngineConfig, ModelSpec, SamplingParams
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine
    from ssdlocal.weights.assets import DEFAULT_TARGET, fetch_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="the GGUF both read (default: the built-in target)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="ours,llamacpp", help="ours, llamacpp or both")
    ap.add_argument("--source", default=str(SOURCE), help="the file the system message holds")
    args = ap.parse_args()
    systems = set(args.systems.split(","))
    torch.set_num_threads(args.threads)
    gguf = args.gguf or str(fetch_gguf(DEFAULT_TARGET))
    engine = Engine(EngineConfig(target=ModelSpec(gguf, "cpu", "bfloat16", "torch", "int4"), prefix_cache_tokens=0))
    src = "\n".join(Path(args.source).read_text().splitlines()[:220])
    messages = [
        {"role": "system", "content": "You review code.\n```python\n" + src + "\n```"},
        {"role": "user", "content": "What does this file do?"},
    ]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    print(f"prompt tokens {len(ids)}, {args.threads} threads, {gguf}", flush=True)
    llm = None
    if "llamacpp" in systems:
        from ssdlocal.backends.llamacpp.lib import high_level_llama

        llm = high_level_llama(
            model_path=gguf,
            n_ctx=len(ids) + 64,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_batch=512,
            verbose=False,
        )
    for repeat in range(1, args.repeats + 1):
        if "ours" in systems:
            done = next(e for e in engine.generate([ids], SamplingParams(max_new_tokens=1)) if isinstance(e, DoneEvent))
            st = done.stats
            print(
                f"repeat {repeat} ours: {st['prefill_ms'] / 1e3:.2f} s = {st['prefill_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
        if llm is not None:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            dt = time.perf_counter() - t0
            print(f"repeat {repeat} llama.cpp: {dt:.2f} s = {len(ids) / dt:.1f} tok/s", flush=True)
    _print_path_costs(len(ids))
    engine.close()
    return 0


def _print_path_costs(rows: int) -> None:
    from ssdlocal.backends.torch import prefill_path

    for key, costs in prefill_path._MEASURED.items():
        kernel, inp, out, dtype, isa = key[:5]
        dense = ", ".join(
            f"{str(d).removeprefix('torch.')} {a * 1e3:.3f} ms/row + {b * 1e3:.1f} ms expansion"
            for d, (a, b) in costs.dense.items()
        )
        choice = costs.best(rows)
        print(
            f"prefill path ({kernel} {inp}x{out}, {isa}): kernel {costs.kernel_per_row * 1e3:.3f} ms/row; {dense}; "
            f"for {rows} rows: {'the kernel' if choice is None else 'dense ' + str(choice).removeprefix('torch.')}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
