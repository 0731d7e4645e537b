"""The steps of scripts/gpu_accept.py that reach past a short answer on one GPU: host waits
per round, long contexts, a churned prefix store, seeded sampling, quantized weights in
graphs, two GPUs, and the bandwidth limit of each forward.

Each step takes the tiny checkpoints (tests/support/tiny_models.py), a device and the script's
`Results`, records its rows with `results.put` and its failures with `results.fail`.
Nothing here is imported by the product.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig, repeatable
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

K = 4
# The most host waits (stream synchronisations that torch.cuda.set_sync_debug_mode reports)
# one decode round may cost, by mode. Over budget is a failure; the counts are reported
# either way. "ssd_target" is reported only: the SSD worker runs in its own process.
HOST_WAIT_BUDGET = {"ar": 1.5, "sd": 1.5, "adaptive_sd": 1.5, "grammar_sd": K + 2, "ssd_target": None}
LONG_PROMPT = 1000  # tokens: with 60 new ones the KV cache grows past 1,024 slots mid-answer
LONG_CONTEXT = 2048  # positions of the long-context copies of the tiny checkpoints
STORE_TOKENS = 256  # a prefix store of 16 blocks, filled and churned by the calls below
# Model shapes of the bandwidth table: (hidden, layers, heads, kv heads, intermediate, vocab, tied)
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "llama-3-70b": (8192, 80, 64, 8, 28672, 128256, False),
}
FORWARDS = [  # (model, role, tensor-parallel ranks): the configurations the product is for
    ("qwen2.5-1.5b", "target", 1),
    ("qwen2.5-0.5b", "draft", 1),
    ("qwen2.5-7b", "target", 1),
    ("qwen2.5-7b", "TP rank 0", 2),
    ("llama-3-70b", "TP rank 0", 4),
    ("llama-3-70b", "TP rank 1..3", 4),
    ("llama-3.2-1b", "draft", 1),
]
KV_TOKENS = 1024  # context the table's KV reads assume


def _config(
    target: str,
    device: str,
    *,
    draft: str | None = None,
    graphs: str = "auto",
    mode: Mode = Mode.SD,
    dtype: str = "float32",
    quantization: str = "none",
    **engine,
) -> EngineConfig:
    spec = SpecConfig(
        mode=mode,
        k=K,
        backup="jit",
        draft=ModelDraft(ModelSpec(draft, device, dtype=dtype)) if draft else SpecConfig().draft,
    )
    return EngineConfig(
        target=ModelSpec(target, device, dtype=dtype, quantization=quantization),
        spec=spec,
        pin_cpus=False,
        graphs=graphs,
        **engine,
    )


def _call(engine: Engine, mode: str, prompts, params: SamplingParams, *, repeat: bool = False, **spec_changes):
    """(token ids per row, the call's stats); `repeat`: proposals that depend only on the
    prompt and the seed (core.config.repeatable, what the server uses for a seeded request)."""
    spec = SpecConfig(mode=Mode(mode), k=K, draft=engine.config.spec.draft, backup="jit", **spec_changes)
    spec = repeatable(spec) if repeat else spec
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
    return [o.token_ids for o in done.outputs], done.stats


def _graph_counts(stats: dict) -> dict[str, int]:
    counts = {"captured": 0, "replays": 0, "refused": 0, "dropped": 0}
    for model in (stats.get("graphs") or {}).values():
        for key in counts:
            counts[key] += model.get(key, 0)
    return counts


def _summed_counts(all_stats) -> dict[str, int]:
    total = {"captured": 0, "replays": 0, "refused": 0, "dropped": 0}
    for stats in all_stats:
        for key, value in _graph_counts(stats).items():
            total[key] += value
    return total


def _graphs_failed(counts: dict) -> bool:
    return counts["replays"] == 0 or counts["refused"] > 0 or counts["dropped"] > 0


# --------------------------------------------------------------------------- host waits
def _counted(engine: Engine, mode: str, prompts, params, spec: dict, grammars=None) -> tuple[int, int]:
    """(synchronisations torch reported, decode rounds) of one call."""
    call_spec = SpecConfig(mode=Mode(mode), k=K, draft=engine.config.spec.draft, backup="jit", **spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            done = [
                e
                for e in engine.generate(prompts, params, spec=call_spec, grammars=grammars)
                if isinstance(e, DoneEvent)
            ][0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught), done.stats.get("rounds", 0)


def host_waits(dirs: dict, device: str, results, step: str = "host_waits") -> None:
    """Host waits per decode round, by mode: a call of 40 tokens minus a call of 1 token
    (the prompt and the first token), over the rounds between them (warm engine)."""
    if not device.startswith("cuda"):
        results.put(
            step,
            {
                "skipped": "torch.cuda.set_sync_debug_mode counts CUDA synchronisations only; "
                "on the CPU the engine's own audit counts them"
            },
        )
        return
    prompts = ["hello world, def foo(x):"]
    modes = [("ar", "ar", {}), ("sd", "sd", {}), ("adaptive_sd", "sd", {"adaptive_k": True}), ("ssd_target", "ssd", {})]
    rows = []
    config = _config(str(dirs["llama"]), device, draft=str(dirs["draft_llama"]), mode=Mode.SSD)
    with Engine(config) as engine:
        grammar = _grammar(engine)
        if grammar is not None:
            modes.append(("grammar_sd", "sd", {}))
        for name, mode, spec in modes:
            grammars = [grammar] if name == "grammar_sd" else None
            long, short = (SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 1))
            run = lambda params: _counted(engine, mode, prompts, params, spec, grammars)  # noqa: E731
            run(long)  # warm: captures, allocations
            waits_long, rounds_long = run(long)
            waits_short, rounds_short = run(short)
            rounds = max(1, rounds_long - rounds_short)
            per_round = (waits_long - waits_short) / rounds
            budget = HOST_WAIT_BUDGET[name]
            rows.append(
                {
                    "mode": name,
                    "waits_per_round": round(per_round, 2),
                    "budget": budget,
                    "rounds": rounds,
                    "waits": waits_long - waits_short,
                }
            )
            results.put(step, rows)
            if budget is not None and per_round > budget:
                results.fail(f"{step}: {name} waits on the host {per_round:.1f} times per round (budget {budget})")
    if grammar is None:
        rows.append({"mode": "grammar_sd", "skipped": "llguidance is not installed (carry its wheel)"})
        results.put(step, rows)


def _grammar(engine: Engine):
    """A JSON-schema grammar for the engine's tokenizer, or None without llguidance."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None
    from ssdlocal.grammar.compiler import GrammarCompiler

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    return GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids).json_schema(schema)


# --------------------------------------------------------------------------- long contexts, prefix store
def long_context(
    dirs: dict,
    device: str,
    graph_mode: str,
    results,
    tmp: Path,
    step: str = "long_context",
    modes: tuple[str, ...] = ("ar", "sd", "ssd"),
) -> None:
    """A 1,000-token prompt and 60 new tokens: the KV cache grows past 1,024 slots in the
    middle of the answer (graphs recaptured on the grown cache) and decode spans pass 256;
    AR, SD and SSD with graphs equal the eager engine."""
    from support.tiny_models import copy_with_context

    target = copy_with_context(dirs["llama"], tmp / "long_llama", LONG_CONTEXT)
    draft = copy_with_context(dirs["draft_llama"], tmp / "long_draft_llama", LONG_CONTEXT)
    prompt = [[5 + (i * 7) % 300 for i in range(LONG_PROMPT)]]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    outs, rows = {}, []
    engine_mode = Mode.SSD if "ssd" in modes else Mode.SD  # an SSD engine starts its worker
    for graphs in ("off", graph_mode):
        with Engine(_config(str(target), device, draft=str(draft), graphs=graphs, mode=engine_mode)) as engine:
            for mode in modes:
                tokens, stats = _call(engine, mode, prompt, params)
                outs[(graphs, mode)] = (tokens, _graph_counts(stats), engine.runner.capacity)
    for mode in modes:
        tokens, counts, capacity = outs[(graph_mode, mode)]
        row = {
            "mode": mode,
            "graphs": graph_mode,
            "prompt_tokens": LONG_PROMPT,
            "kv_slots": capacity,
            "equal_eager": tokens == outs[("off", mode)][0],
            "equal_ar": tokens == outs[("off", "ar")][0],
            **counts,
        }
        rows.append(row)
        if not (row["equal_eager"] and row["equal_ar"]) or _graphs_failed(counts) or capacity <= 1024:
            results.fail(f"{step}: {mode} graphs={graph_mode}: {row}")
    results.put(step, rows)


def churned_store(dirs: dict, device: str, graph_mode: str, results, step: str = "churned_prefix_store") -> None:
    """A prefix store of 16 blocks, filled and evicted by calls that share heads: every
    call equals an engine without the store, and the store reuses and evicts."""
    heads = [[5 + (i * 7 + 11 * f) % 300 for i in range(64)] for f in range(3)]
    calls = [[heads[(n + f) % 3] + [9 + n, 8, 7 + f] * 6] for n in range(4) for f in range(3)]  # 12 calls
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    got = {}
    for store in (0, STORE_TOKENS):
        config = _config(
            str(dirs["llama"]),
            device,
            draft=str(dirs["draft_llama"]),
            graphs=graph_mode,
            mode=Mode.SD,
            prefix_cache_tokens=store,
        )
        with Engine(config) as engine:
            got[store] = [_call(engine, "sd", prompts, params) for prompts in calls]
            report = engine.runner.prefix_report() or {}
            pool = getattr(engine.runner.model, "prefix_pool", None)
            copies = getattr(pool, "copies", None)  # copy operations, where the pool counts them
    cached = [stats.get("cached_prompt_tokens", 0) for _, stats in got[STORE_TOKENS]]
    row = {
        "calls": len(calls),
        "equal_without_store": [t for t, _ in got[STORE_TOKENS]] == [t for t, _ in got[0]],
        "cached_tokens": cached,
        "evicted_tokens": report.get("evicted_tokens"),
        "reused_tokens": report.get("reused_tokens"),
        "copy_operations": copies,
        **_summed_counts(stats for _, stats in got[STORE_TOKENS]),
    }
    results.put(step, row)
    if not row["equal_without_store"]:
        results.fail(f"{step}: answers differ with a churned prefix store")
    if graph_mode != "off" and _graphs_failed(row):
        results.fail(f"{step}: graphs {row}")
    if not report.get("evicted_tokens") or not sum(cached):
        results.fail(
            f"{step}: the store was not churned (evicted {report.get('evicted_tokens')}, reused {sum(cached)})"
        )


# --------------------------------------------------------------------------- sampling, quantized weights
def seeded_sampling(dirs: dict, device: str, graph_mode: str, results, step: str = "seeded_sampling") -> None:
    """T = 0.8, top-p 0.9, proposals made repeatable as the server makes a seeded request's:
    the same seed gives the same tokens twice in AR, SD and SSD with graphs on (whether
    another seed differs is reported, to show the sampling is not greedy)."""
    config = _config(str(dirs["qwen2"]), device, draft=str(dirs["draft_qwen2"]), graphs=graph_mode, mode=Mode.SSD)
    prompts = ["the cat sat", "hello world, def foo(x):"]
    rows = []
    with Engine(config) as engine:
        for mode in ("ar", "sd", "ssd"):
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=20, ignore_eos=True)
            first, stats = _call(engine, mode, prompts, params, repeat=True)
            again, _ = _call(engine, mode, prompts, params, repeat=True)
            other, _ = _call(engine, mode, prompts, replace(params, seed=8), repeat=True)
            row = {
                "mode": mode,
                "graphs": graph_mode,
                "repeats": first == again,
                "other_seed_differs": other != first,
                **_graph_counts(stats),
            }
            rows.append(row)
            if not row["repeats"] or (graph_mode != "off" and _graphs_failed(row)):
                results.fail(f"{step}: {mode}: {row}")
    results.put(step, rows)


def quantized_graphs(dirs: dict, device: str, graph_mode: str, results, step: str = "quantized_graphs") -> None:
    """int8 and int4 weights: greedy AR and SD with graphs equal eager, and replay."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    rows = []
    for scheme in ("int8", "int4"):
        outs = {}
        for graphs in ("off", graph_mode):
            config = _config(
                str(dirs["llama"]),
                device,
                draft=str(dirs["draft_llama"]),
                graphs=graphs,
                dtype=dtype,
                quantization=scheme,
            )
            with Engine(config) as engine:
                for mode in ("ar", "sd"):
                    outs[(graphs, mode)] = _call(
                        engine,
                        mode,
                        ["hello world, def foo(x):", "the cat"],
                        SamplingParams(max_new_tokens=16, ignore_eos=True),
                    )
        for mode in ("ar", "sd"):
            tokens, stats = outs[(graph_mode, mode)]
            row = {
                "weights": scheme,
                "dtype": dtype,
                "mode": mode,
                "graphs": graph_mode,
                "equal_eager": tokens == outs[("off", mode)][0],
                **_graph_counts(stats),
            }
            rows.append(row)
            if not row["equal_eager"] or _graphs_failed(row):
                results.fail(f"{step}: {scheme} {mode}: {row}")
        results.put(step, rows)


# --------------------------------------------------------------------------- two GPUs
def two_devices(
    dirs: dict,
    device: str,
    graph_mode: str,
    results,
    step: str = "two_devices",
    modes: tuple[str, ...] = ("ar", "sd", "ssd"),
) -> None:
    """A tensor-parallel target over two devices (every rank captures its steps) in AR, SD
    and SSD, and SSD with the draft on the second GPU: each equals one eager device. On
    the CPU (--cpu) the TP part runs over two CPU ranks with traced graphs."""
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        results.put(
            step,
            {
                "skipped": f"{torch.cuda.device_count()} GPU here: the TP step and SSD across two "
                "GPUs need two or more (rerun on such a machine)"
            },
        )
        return
    second = "cuda:1" if device.startswith("cuda") else "cpu"
    target, draft = str(dirs["llama"]), str(dirs["draft_llama"])
    prompts = ["The quick brown fox", "hello world, def foo(x):"]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine_mode = Mode.SSD if "ssd" in modes else Mode.SD
    with Engine(_config(target, device, draft=draft, graphs="off", mode=engine_mode)) as one:
        want = {mode: _call(one, mode, prompts, params)[0] for mode in modes}
    rows = []
    tp = _config(target, device, draft=draft, graphs=graph_mode, mode=engine_mode, target_devices=(device, second))
    with Engine(tp) as engine:
        for mode in modes:
            tokens, stats = _call(engine, mode, prompts, params)
            target_counts = (stats.get("graphs") or {}).get("target", {})
            rows.append(
                {
                    "what": f"TP=2 target, {mode}",
                    "graphs": graph_mode,
                    "equal_one_device": tokens == want[mode],
                    "target_replays": target_counts.get("replays", 0),
                }
            )
    if device.startswith("cuda") and "ssd" in modes:
        split = _config(target, device, draft=draft, graphs=graph_mode, mode=Mode.SSD)
        split = replace(split, spec=replace(split.spec, draft=ModelDraft(ModelSpec(draft, second, dtype="float32"))))
        with Engine(split) as engine:
            tokens, stats = _call(engine, "ssd", prompts, params)
            rows.append(
                {
                    "what": f"SSD, target {device}, draft {second}",
                    "graphs": graph_mode,
                    "equal_one_device": tokens == want["ssd"],
                    "target_replays": (stats.get("graphs") or {}).get("target", {}).get("replays", 0),
                }
            )
    results.put(step, rows)
    for row in rows:
        if not row["equal_one_device"] or not row["target_replays"]:
            results.fail(f"{step}: {row}")


# --------------------------------------------------------------------------- bandwidth limits
def forward_bytes(name: str, role: str, tp: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(weight bytes, KV bytes at KV_TOKENS) one forward of `role` reads: a rank reads 1/tp
    of every layer; rank 0 also the lm_head (the other ranks compute no logits)."""
    hidden, layers, heads, kv, inter, vocab, _tied = SHAPES[name]
    head_dim = hidden // heads
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
    per_layer = (attn + 3 * hidden * inter) // tp + 2 * hidden  # split linears; norms replicated
    lm_head = 0 if role.startswith("TP rank 1") else hidden * vocab
    weights = (layers * per_layer + lm_head + hidden) * dtype_bytes
    kv_bytes = 2 * layers * (kv // tp) * head_dim * KV_TOKENS * dtype_bytes
    return weights, kv_bytes


def bandwidth_table(bandwidth: float, results, measured: dict | None = None, step: str = "bandwidth_limits") -> None:
    """The bandwidth limit of one decode forward per configuration (bf16 weights + KV of
    KV_TOKENS tokens / measured copy bandwidth), beside the measured graph step where
    step_times has one (`measured`: model -> T=1 graphs ms)."""
    rows = []
    for name, role, tp in FORWARDS:
        weights, kv_bytes = forward_bytes(name, role, tp)
        limit = (weights + kv_bytes) / bandwidth * 1e3
        row = {
            "model": name,
            "role": role,
            "tp": tp,
            "weights_gb": round(weights / 1e9, 3),
            "kv_gb": round(kv_bytes / 1e9, 4),
            "limit_ms": round(limit, 3),
        }
        if measured and tp == 1 and name in measured:
            row["measured_ms"] = round(measured[name], 3)
            row["measured_over_limit"] = round(measured[name] / limit, 2)
        rows.append(row)
    results.put(step, {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "kv_tokens": KV_TOKENS, "rows": rows})
