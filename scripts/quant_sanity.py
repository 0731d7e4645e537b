"""Real-model sanity check of quantized weights: load time and peak memory, AR speed, and
agreement with the bf16 model, for bf16 / int8 / int4 (and int4 with a bf16 lm_head).

Each variant runs in a fresh process (so VmHWM is its own peak): it loads the model
(GGUF -> quantized cache on first use, timed separately), runs `--tokens` greedy AR
tokens (torch threads = `--threads`), and scores a fixed text teacher-forced: top-1
agreement with bf16 and mean KL(bf16 || variant) per position.

    python scripts/quant_sanity.py --gguf ~/.cache/ssdlocal/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --bf16 ~/.cache/ssdlocal/converted/qwen2.5-coder-0.5b-...-bfloat16-<key>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n'
    "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n"
    "The function walks both lists once, so it runs in linear time. A binary search tree keeps "
    "its keys ordered: every key in the left subtree is smaller than the root, and every key in "
    "the right subtree is larger. In Python, dictionaries preserve insertion order since 3.7."
)
PROMPT = "Write a Python function that checks whether a string is a palindrome."

CHILD = r"""
import json, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
if args["float_lm_head"]:  # every architecture's lm_head stays in floats
    from dataclasses import replace
    from ssdlocal.weights.formats import arch, archs
    for a in archs.architectures():
        archs.unregister(a.name)
        archs.register(replace(a, linears={**a.linears, "lm_head": arch.Linear(quantized=False)}))
from ssdlocal.core.config import EngineConfig, ModelSpec, SamplingParams, SpecConfig, Mode
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from ssdlocal.backends.torch.quant_apply import model_bytes

def status_mb(field):
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith(field)) / 1024

t0 = time.perf_counter()
spec = ModelSpec(args["path"], dtype="bfloat16", quantization=args["quantization"])
with Engine(EngineConfig(target=spec, spec=SpecConfig(mode=Mode.AR), pin_cpus=False)) as eng:
    load_s = time.perf_counter() - t0
    load_peak = status_mb("VmHWM")
    params = SamplingParams(temperature=0.0, max_new_tokens=args["tokens"], ignore_eos=True)
    ids = eng.encode(args["prompt"], True)
    runs = []
    for _ in range(args["repeats"]):
        done = [e for e in eng.generate([ids], params) if isinstance(e, DoneEvent)][0]
        runs.append(done.stats["tokens_per_s"])
    run_peak = status_mb("VmHWM")  # load + AR, before the scoring below
    text_ids = eng.tokenizer(args["text"]).input_ids
    runner = eng.runner
    runner.reset(1, len(text_ids) + 2)
    logits = runner.feed([text_ids])[0].float()  # [T, V]
    torch.save(logits.to(torch.float16), args["logits"])
    print(json.dumps({"load_s": load_s, "load_peak_mb": load_peak, "run_peak_mb": run_peak,
                      "weights_mb": model_bytes(eng.target.model) / 2**20, "tok_s": runs,
                      "quantization": eng.target.quantization, "tokens": list(done.outputs[0].token_ids)}))
"""


def run_variant(name: str, path: str, quantization: str, opts, float_lm_head: bool = False) -> dict:
    args = {
        "path": path,
        "quantization": quantization,
        "threads": opts.threads,
        "tokens": opts.tokens,
        "repeats": opts.repeats,
        "prompt": PROMPT,
        "text": TEXT,
        "float_lm_head": float_lm_head,
        "logits": f"{opts.out}/{name}.pt",
    }
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(opts.threads), "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    if float_lm_head:  # its own cache: the cache key does not know about this experiment
        env["SSDLOCAL_CACHE"] = f"{opts.out}/cache-float-lm-head"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the Q4_K_M GGUF file")
    ap.add_argument("--bf16", required=True, help="its bf16 conversion (a checkpoint directory)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="/tmp/quant-sanity")
    ap.add_argument("--variants", default="bf16,int8,int4,int4-bf16-lm-head")
    opts = ap.parse_args()
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    import torch

    specs = {
        "bf16": (opts.bf16, "none", False),
        "int8": (opts.gguf, "int8", False),
        "int4": (opts.gguf, "int4", False),
        "int4-bf16-lm-head": (opts.gguf, "int4", True),
    }
    results = {}
    for name in opts.variants.split(","):
        path, quant, float_head = specs[name]
        for attempt in ("convert", "run"):  # the first load of a GGUF converts it: time it apart
            if quant == "none" and attempt == "convert":
                continue
            results[name] = run_variant(name, path, quant, opts, float_head)
            results[name]["phase"] = attempt
            if attempt == "convert":
                results[name + " (first load)"] = {
                    "load_s": results[name]["load_s"],
                    "load_peak_mb": results[name]["load_peak_mb"],
                }
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "tokens"}), flush=True)
    ref = torch.load(f"{opts.out}/bf16.pt").float() if "bf16" in results else None
    print("\n| variant | weights MB | load s (first) | peak MB (load / run) | AR tok/s | top-1 vs bf16 | KL vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "tok_s" not in r:
            continue
        agree = kl = float("nan")
        if ref is not None:
            q = torch.load(f"{opts.out}/{name}.pt").float()
            agree = float((q.argmax(-1) == ref.argmax(-1)).float().mean())
            p_log, q_log = ref.log_softmax(-1), q.log_softmax(-1)
            kl = float((p_log.exp() * (p_log - q_log)).sum(-1).mean())
        first = results.get(name + " (first load)", {}).get("load_s")
        first_s = f" ({first:.1f})" if first else ""
        print(
            f"| {name} | {r['weights_mb']:.0f} | {r['load_s']:.1f}{first_s} | {r['load_peak_mb']:.0f} / "
            f"{r['run_peak_mb']:.0f} | {max(r['tok_s']):.2f} | {agree:.3f} | {kl:.4f} |"
        )


if __name__ == "__main__":
    main()
