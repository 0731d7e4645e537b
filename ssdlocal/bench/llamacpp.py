"""One-shot CPU benchmark of the llama.cpp backend: our AR / SD / SSD next to llama-cpp-python.

    python -m ssdlocal.bench.llamacpp [--max-new-tokens 64] [--prompts 4] [--k 4]

Runs the GGUF Qwen2.5-Coder 1.5B target (0.5B draft) through our engine with the
llama.cpp backend in AR, SD (draft model and n-gram) and SSD, then llama-cpp-python's
own `Llama.generate` plain and with `LlamaPromptLookupDecoding`, greedy, on the same
chat-formatted prompts, one after the other. Prints a table (decode tokens/s, prefill
excluded) and writes JSON. Reports whether every mode reproduced our AR's tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from ssdlocal.backends.base import Logits
from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, NgramDraft, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import BackendName
from ssdlocal.weights.assets import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_path

log = logging.getLogger(__name__)


def _ours(engine, ids, params, spec):
    """(tokens per prompt, decode tokens, decode seconds, stats of the last prompt)."""
    outs, tokens, seconds, stats = [], 0, 0.0, None
    for prompt in ids:
        done = next(e for e in engine.generate([prompt], params, spec=spec) if isinstance(e, DoneEvent))
        stats = done.stats
        outs.append(list(done.outputs[0].token_ids))
        tokens += max(len(outs[-1]) - 1, 0)  # the first token belongs to prefill
        seconds += stats.decode_s
    return outs, tokens, seconds, stats


def _peer(llm, ids, params, eos):
    """llama-cpp-python's own loop; decode time from the first token to the last."""
    outs, tokens, seconds = [], 0, 0.0
    for prompt in ids:
        llm.reset()
        out, t_first = [], None
        for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            t_first = t_first or time.perf_counter()
            out.append(int(tok))
            if (not params.ignore_eos and tok in eos) or len(out) >= params.max_new_tokens:
                break
        seconds += time.perf_counter() - t_first
        tokens += len(out) - 1
        outs.append(out)
    return outs, tokens, seconds


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from ssdlocal.bench.prompts import load_prompts, select
    from ssdlocal.engine import Engine

    modes = args.modes.split(",")
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    target = ModelSpec(args.target, backend=BackendName.LLAMACPP)
    draft = ModelDraft(ModelSpec(args.draft, backend=BackendName.LLAMACPP))
    cfg = EngineConfig(target=target, spec=SpecConfig(mode=Mode.SSD, k=args.k, draft=draft))
    prompts = [p.prompt for p in select(load_prompts(), args.prompts)]
    results: dict[str, dict] = {}
    t_load = time.perf_counter()
    with Engine(cfg) as eng:
        log.warning("loaded in %.1fs", time.perf_counter() - t_load)
        ids = [eng.encode(p, chat=True) for p in prompts]
        eos = eng.eos_ids
        runs = {
            "ar": SpecConfig(mode=Mode.AR),
            "sd": SpecConfig(mode=Mode.SD, k=args.k, draft=draft),
            "sd-ngram": SpecConfig(mode=Mode.SD, k=args.k, draft=NgramDraft()),
            "ssd": SpecConfig(mode=Mode.SSD, k=args.k, draft=draft),
        }
        _ours(eng, ids[:1], replace_max(params, 4), runs["ar"])  # warm-up
        for name, spec in runs.items():
            if name not in modes:
                continue
            outs, n, s, stats = _ours(eng, ids, params, spec)
            results[name] = {
                "tokens": n,
                "seconds": s,
                "tokens_per_s": n / s,
                "outputs": outs,
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_len": stats.mean_accepted_len,
                "cache_hit_rate": stats.cache_hit_rate,
                "last_prompt_draft_ms": stats.draft_ms,
                "last_prompt_verify_ms": stats.verify_ms,
                "last_prompt_rounds": stats.rounds,
            }
            print(f"{name:12s} {n / s:7.2f} tok/s  ({n} tokens, {s:.1f}s)", flush=True)
        if "peer" in modes or "peer-lookup" in modes:
            _run_peers(args, modes, ids, params, eos, threads, results)
        _compare_with_ar(eng, ids, results)
    summary = {
        "target": args.target,
        "draft": args.draft,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(ids),
        "threads": threads,
        "cpus": os.cpu_count(),
        "load_avg_end": os.getloadavg(),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    _print_table(results)
    return summary


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(gguf_path(DEFAULT_TARGET)))
    ap.add_argument("--draft", default=str(gguf_path(DEFAULT_DRAFT)))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument("--modes", default="ar,sd,sd-ngram,ssd,peer,peer-lookup")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for AR/SD and the peers (0 = torch's default); SSD splits the cores",
    )
    ap.add_argument(
        "--peer-flash-attn",
        choices=("on", "off"),
        default="on",
        help="flash attention for the peers (ours: llama.cpp's auto, on for CPU)",
    )
    ap.add_argument("--out", default="llamacpp_bench.json")
    return ap


def _compare_with_ar(eng, ids, results: dict[str, dict]) -> None:
    """Each mode's `same_as_ar`, `first_divergence` (with the target's top-2 logit gap
    there) and `speedup_vs_ar`, where AR ran."""
    ar = results.get("ar", {}).get("outputs")
    for name, r in results.items():
        if ar is not None and name != "ar":
            r["same_as_ar"] = r["outputs"] == ar
            r["first_divergence"] = _first_divergence(ar, r["outputs"])
            _add_margin(eng, ids, ar, r["first_divergence"])
        if "ar" in results:
            r["speedup_vs_ar"] = r["tokens_per_s"] / results["ar"]["tokens_per_s"]


def _print_table(results: dict[str, dict]) -> None:
    print(f"\n{'mode':12s} {'tok/s':>7s} {'x AR':>6s} {'accept':>7s} {'hit':>5s}  same tokens as our AR")
    for name, r in results.items():
        acc = r.get("acceptance_rate")
        hit = r.get("cache_hit_rate")
        print(
            f"{name:12s} {r['tokens_per_s']:7.2f} {r.get('speedup_vs_ar', 1):6.2f} "
            f"{'' if acc is None else f'{acc:.2f}':>7s} {'' if hit is None else f'{hit:.2f}':>5s}  "
            f"{r.get('same_as_ar', '')} {r.get('first_divergence') or ''}"
        )


def _run_peers(args, modes, ids, params, eos, threads, results) -> None:
    """llama-cpp-python plain and with LlamaPromptLookupDecoding, same prompts and threads."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ssdlocal.backends.llamacpp.lib import high_level_llama

    n_ctx = max(map(len, ids)) + args.max_new_tokens + 64
    for name in ("peer", "peer-lookup"):
        if name not in modes:
            continue
        lookup = LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)
        llm = high_level_llama(
            model_path=args.target,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            draft_model=lookup if name == "peer-lookup" else None,
            flash_attn=args.peer_flash_attn == "on",
        )
        _peer(llm, ids[:1], replace_max(params, 4), eos)  # warm-up
        outs, n, s = _peer(llm, ids, params, eos)
        results[name] = {"tokens": n, "seconds": s, "tokens_per_s": n / s, "outputs": outs}
        print(f"{name:12s} {n / s:7.2f} tok/s  ({n} tokens, {s:.1f}s)", flush=True)
        llm.close()


def _add_margin(engine, ids, ar, div) -> None:
    """Add the target's logits at the divergence (one forward over prompt + AR prefix)."""
    import torch

    if not div or "got" not in div:
        return
    prefix = ids[div["prompt"]] + ar[div["prompt"]][: div["index"]]
    engine.runner.reset(1, len(prefix) + 2)
    logits = engine.runner.feed([prefix], Logits.LAST)[0][-1]  # [V]
    top = torch.topk(logits, 2)
    div["top2"] = top.indices.tolist()
    div["top2_margin"] = float(top.values[0] - top.values[1])
    div["logit_ar_minus_got"] = float(logits[div["ar"]] - logits[div["got"]])


def replace_max(params: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_new_tokens=n)


def _first_divergence(ref: list[list[int]], got: list[list[int]]):
    for p, (a, b) in enumerate(zip(ref, got)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"prompt": p, "index": i, "ar": x, "got": y}
        if len(a) != len(b):
            return {"prompt": p, "index": min(len(a), len(b)), "length": [len(a), len(b)]}
    return None


if __name__ == "__main__":
    main()
