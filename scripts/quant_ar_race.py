"""Plain (AR) decoding of one GGUF target at several weight formats, interleaved in one run.

`ssdlocal bench` runs one quantization per run; this loads the target once per format
(torch backend: bf16 = `--quantization none`, int8, int4; plus llama.cpp on the file
itself when llama-cpp-python is installed), then for every prompt and repeat runs each
format in a rotating order, so machine noise falls on all of them alike. Prints decode
tokens/s (prefill excluded) per format and its ratio to bf16, and writes them as JSON.

    python scripts/quant_ar_race.py --gguf ~/.cache/ssdlocal/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --prompts prompts.jsonl --limit 4 --tokens 64 --out quant_ar_race.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

from ssdlocal.bench.prompts import load_prompts, select
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine


def engines(gguf: str, formats: list[str]) -> dict[str, Engine]:
    out = {}
    for fmt in formats:
        backend, quant = ("llamacpp", "none") if fmt == "llamacpp" else ("torch", "none" if fmt == "bf16" else fmt)
        spec = ModelSpec(gguf, dtype="bfloat16", backend=backend, quantization=quant)
        out[fmt] = Engine(EngineConfig(target=spec, spec=SpecConfig(mode=Mode.AR)))
    return out


def decode_rate(engine: Engine, prompt: str, tokens: int) -> float:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    done = next(e for e in engine.generate([prompt], params, chat=True) if isinstance(e, DoneEvent))
    return done.stats["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", default=None, help="JSONL or text file (default: the built-in set)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--formats", default="bf16,int8,int4,llamacpp")
    ap.add_argument("--out", default="quant_ar_race.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    if "llamacpp" in formats and importlib.util.find_spec("llama_cpp") is None:
        formats.remove("llamacpp")
        print("llama-cpp-python is not installed: llamacpp skipped")
    prompts = [p.prompt for p in select(load_prompts(args.prompts), args.limit)]
    loaded = engines(args.gguf, formats)
    rates: dict[str, list[float]] = {f: [] for f in formats}
    try:
        for fmt in formats:  # warm-up: first-call allocations, thread pools
            decode_rate(loaded[fmt], prompts[0], 8)
        turn = 0
        for _ in range(args.repeats):
            for prompt in prompts:
                order = formats[turn % len(formats) :] + formats[: turn % len(formats)]
                turn += 1
                for fmt in order:
                    rates[fmt].append(decode_rate(loaded[fmt], prompt, args.tokens))
                    print(f"{fmt:9s} {rates[fmt][-1]:6.2f} tok/s", flush=True)
    finally:
        for engine in loaded.values():
            engine.close()
    medians = {f: statistics.median(r) for f, r in rates.items()}
    base = medians.get("bf16")
    print("\n| weights | decode tok/s (median) | vs bf16 |\n|---|---|---|")
    for fmt, rate in medians.items():
        print(f"| {fmt} | {rate:.2f} | {rate / base:.2f}x |" if base else f"| {fmt} | {rate:.2f} | – |")
    Path(args.out).write_text(
        json.dumps({"gguf": args.gguf, "tokens": args.tokens, "rates": rates, "medians": medians}, indent=1)
    )


if __name__ == "__main__":
    main()
