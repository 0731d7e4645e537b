"""GPU acceptance: one command that says whether this GPU runs ssdlocal correctly, and how fast.

    python scripts/gpu_accept.py --out DIR            # one NVIDIA GPU, no network, < 8 minutes
    python scripts/gpu_accept.py --out DIR --cpu      # a smoke run on the CPU (checks the script)

Needs only torch and transformers (which brings tokenizers, safetensors, numpy and
huggingface-hub): the engine imports nothing else. Tiny checkpoints are written to a temp
dir (tests/support/tiny_models.py); the timing models are random bf16 weights in Qwen2.5 shapes.
If an import fails on a machine that has no network, carry the wheel: on a machine with
network `pip download <package> --no-deps -d wheels/`, copy `wheels/` beside this
checkout, then `pip install --no-index --find-links wheels <package>`.

Steps (each writes DIR/results.json and DIR/results.md before the next starts, so a run
cut short still leaves what it found; exit code 1 if any exactness check fails; each
section of results.md says what its rows measure):
  1. environment: torch, GPU, measured device-copy bandwidth and bf16 matmul FLOP/s;
  2. graphs == eager == AR == fresh, fp32 greedy, llama / qwen2 / qwen3: one engine per
     graph mode runs a sequence of calls (batch sizes 1, 1, 3, 2; a prompt longer than 64
     tokens, then turns that re-send it with more: the prefix cache serves them) in AR, SD
     and SSD with the draft on the same GPU; every call equals the eager engine's, AR's, and
     an eager engine's without the prefix cache; graphs captured and replayed, none refused
     or dropped; the calls' cached prompt tokens are reported;
  2b. constrained decoding: a batch with a JSON-schema row, an unconstrained row and a regex
     row in AR, SD and SSD, with graphs on: every mode equals constrained eager AR and every
     constrained row follows its grammar (needs llguidance: `pip install llguidance`, a
     wheel with no dependencies; the step is reported as skipped without it);
  3. step times at T=1 and T=K+1 for Qwen2.5-1.5B and 7B shapes in bf16 (eager and graphs)
     against the bandwidth limit (weight bytes / measured bandwidth), and the prefill of a
     2,048-token prompt against the compute limit (2 x parameters x tokens / measured bf16
     matmul FLOP/s);
  4. which attention kernel each kind of step ran (profiler kernel names, and torch's own
     can-use checks for the shapes the model passes);
  5. (scripts/accept_speed.py) attention at 1k, 8k and 32k spans: the first --models
     shape's T=1 and T=K+1 steps through both masked-step paths (the folded
     memory-efficient kernel and the batched matmuls), against the bandwidth limit of its
     weights plus the span's K/V bytes, the two paths compared in float32 on the GPU
     (a difference past 1e-5 fails); then int8 and int4 weights (quantized on the GPU)
     against bf16: step times per --models shape against their own bandwidth limit and
     as a ratio to bf16, with what a load would decide (backends/torch/quant_speed.py);
  5b. (scripts/accept_families.py) the 2026 families in timing shapes: a Qwen3-30B-A3B-shaped
     mixture of experts and a Gemma 3 12B-class sliding-window model (12 of 48 layers each),
     random bf16 weights, T=1 and T=K+1 steps eager and in captured graphs against the
     bandwidth limit of the bytes each step reads (the experts its tokens chose, the KV it
     attends to), the captured step's logits against eager's;
  5c. (scripts/accept_hybrid.py) a Qwen3.5-9B-shaped hybrid (8 of its 32 layers: two periods
     of three Gated DeltaNet layers and one full-attention layer), random bf16 weights: T=1
     and T=K+1 steps eager and in captured graphs against the bandwidth limit of the weights,
     the full-attention KV and the linear states read and written; the states a verify keeps
     to roll back to any accepted length (bytes, and the time of their writes); captured
     logits against eager's;
  5d. (scripts/accept_rounds.py) SD rounds through the engine in timing shapes, checkpoints
     of random bf16 weights written from the device: that hybrid with a small random draft
     model, and an EAGLE-3 head of the published Llama-3.1-8B head's shape (hidden 4096, one
     layer, 32,000 draft ids) beside a Llama-3.1-8B-shaped target (8 of 32 layers): host
     waits per round with graphs against HOST_WAIT_BUDGET["sd"], draft and verify ms per
     round, graph counts, and in float32 SD with graphs == AR with graphs == eager AR;
  6. (scripts/accept_steps.py) host waits per decode round under
     torch.cuda.set_sync_debug_mode, by mode, against HOST_WAIT_BUDGET (AR, SD, adaptive
     SD <= 1.5, SD under a JSON-schema grammar <= K + 2; SSD's target reported); a
     1,100-token prompt (KV past 1,024 slots, spans past 256) in AR/SD/SSD; a 16-block
     prefix store filled and churned by 12 calls; seeded sampling at T = 0.8 repeating;
     int8 and int4 weights inside graphs; a TP=2 target and SSD with the draft on a second
     GPU when two or more are present (a clear "skipped" line otherwise); the
     bandwidth-limit table per forward (target, draft, TP rank; 70B-class at TP=4);
  7. last, step 2's sequence with SSDLOCAL_GRAPHS=trace (the CPU twin of CUDA graphs) on
     the GPU: the slowest step, and the one a run cut short can best do without.
Every bf16 timing model whose graphs were refused or dropped is a failure. A run past
--budget-s (default 480 s on a GPU) marks the steps it did not reach as failures, never
as passes.
What a GPU run needs beyond torch, triton and transformers: nothing except the grammar
rows (llguidance, one wheel with no dependencies: they are reported as skipped without
it). `--cpu` is a smoke run of the same code on the CPU with traced graphs (one
architecture, fewer calls, no SSD worker in the long-context and two-device steps, the
TP step over two CPU ranks; step 5 on the tiny timing shape in float32, traced graphs, both
attention paths forced, no load-time verdict; steps 5b-5d on tiny shapes, the rounds' host
waits from the engine's own audit) to check the script; `--steps a,b` runs only the named
steps (and environment). The host-wait, step
time, prefill and kernel steps need a GPU, and CPU timings say nothing about a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import accept_speed as speed  # noqa: E402
import torch  # noqa: E402
from ssdlocal.core.config import ModelDraft  # noqa: E402

K = 4
CALLS = [  # (prompts, new tokens): the same batch size twice, then others, a long prompt
    (["The quick brown fox"], 24),
    (["hello world, def foo(x):"], 24),
    (["Once upon a time", "a", "def bar(y): return"], 16),
    ([" ".join(f"w{i}" for i in range(70))], 16),
    (["the cat sat", "x = 1"], 20),
    ([" ".join(f"w{i}" for i in range(70)) + " and then some more words"], 16),  # the prefix cache serves it
    ([" ".join(f"w{i}" for i in range(70)) + " and then", "the cat sat on"], 12),
]
PAIRS = {"llama": "draft_llama", "qwen2": "draft_qwen2", "qwen3": "qwen3"}


class Results:
    """Results so far, written after every step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"steps": {}, "failures": []}
        out.mkdir(parents=True, exist_ok=True)

    def put(self, step: str, value) -> None:
        self.data["steps"][step] = value
        self.write()

    def fail(self, what: str) -> None:
        print(f"FAIL: {what}", flush=True)
        self.data["failures"].append(what)
        self.write()

    def write(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "results.md").write_text(render(self.data))


MEASURES = {  # step: what each of its rows measures (printed under its heading)
    "environment": "the machine: torch, the device, its measured copy bandwidth (read + write) and, "
    "on a GPU, bf16 matmul FLOP/s (8192^3); the limits below divide by these",
    "exact_cuda_graphs": "one row per (architecture, mode, graph mode): a sequence of calls (batch "
    "sizes 1, 1, 3, 2, a prompt past 64 tokens, turns the prefix cache serves; --cpu: the last "
    "four), float32 greedy; True when every call's tokens equal the eager engine's, AR's, and an "
    "eager engine's without the prefix cache; graph counts summed over the calls",
    "exact_constrained": "one row per (architecture, mode): a JSON-schema row, a free row and a regex "
    "row with graphs on equal constrained eager AR, and each constrained row follows its grammar",
    "step_times": f"one forward of a random-weight bf16 model after a 512-token prompt, median ms: "
    f"T=1 (decode) and T={K + 1} (a K={K} verify), eager and graphs, against the bandwidth limit "
    "(weight bytes / measured copy bandwidth)",
    "attention_spans": "one row per (span, T, path): median ms of a step whose attention reads "
    "`span` slots of K/V through that path (efficient-folded: the memory-efficient kernel with "
    "the query groups folded in; batched-matmul: two GEMMs spread over the keys; cuda_picks: "
    "the path the product takes there), against the bandwidth limit of the weights plus the "
    "span's K/V bytes (kv_share: the K/V's part); f32_paths_max_diff: the two paths' outputs "
    "in float32 on this device (exact: at most 1e-5, else a failure); *_logits_max_diff: the "
    "model's last logits by the two paths in its own dtype (rounding, reported only)",
    "quant_speed": f"one row per (model, weights): median ms of a T=1 and a T={K + 1} step with "
    "dense, int8 or int4 weights (quantized on this device, graphs on a GPU), against the "
    "bandwidth limit of those weights' bytes plus the prompt's K/V, and as a ratio to dense; "
    "load_verdict: what loading with that scheme decides here (its MLP projections timed "
    "through the kernel against dense at 1 and 5 rows)",
    "prefill": "a cold 2,048-token prompt (one row, chunked layer by layer), best of 3, bf16 and "
    "int4 weights, against the measured bf16 matmul peak (2 x parameters x tokens FLOP)",
    "attention_kernels": "the attention kernels the profiler saw per kind of step at a 512-token "
    "span, and torch's own can-use checks for the folded verify",
    "family_step_times": f"one row per (2026 family in timing shapes, T): median ms of a T=1 and a T={K + 1} "
    "step, eager and in captured graphs, of a random-weight bf16 model (scripts/accept_families.py), against "
    "the bandwidth limit of the bytes the step reads (the experts its tokens chose, the KV it attends to); "
    "bitwise / argmax_equal: the captured step's logits against eager's (a different argmax is a failure)",
    "hybrid_step_times": f"one row per T (1 and {K + 1}) of a Qwen3.5-9B-shaped hybrid, 8 of 32 layers "
    "(scripts/accept_hybrid.py), random bf16 weights: median ms eager and in captured graphs against the "
    "bandwidth limit of the weights, the full-attention layers' KV and the linear states read and written; "
    "kept_mb / kept_ms: the T states per row a verify keeps to roll back to any accepted length and the "
    "time of their writes; bitwise / argmax_equal: captured against eager (a different argmax is a failure)",
    "hybrid_rounds": "SD rounds through the engine (a small random draft model: K proposals a round, nearly all rejected) with the Qwen3.5-9B-shaped hybrid "
    "written as a checkpoint (scripts/accept_rounds.py): host waits per round with graphs (a 40-token call "
    "minus a 1-token one; torch's sync count on a GPU, the engine's audit beside it and alone on the CPU) "
    "against the SD budget, draft and verify ms per round in bf16, graph counts; float32: SD with graphs "
    "equals AR with graphs and eager AR, token for token",
    "head_rounds": "as hybrid_rounds with an EAGLE-3 head of the published Llama-3.1-8B head's shape (hidden "
    "4096, one layer, 32,000 draft ids mapped into 128,256) beside a Llama-3.1-8B-shaped target (8 of 32 "
    "layers): head draft ms against verify ms per round, host waits per round, exactness against AR",
    "host_waits": "host synchronisations per decode round by mode (torch.cuda.set_sync_debug_mode: "
    "a 40-token call minus a 1-token one), against HOST_WAIT_BUDGET",
    "long_context": "a 1,000-token prompt and 60 new tokens (the KV cache grows past 1,024 slots "
    "mid-answer, spans pass 256): graphs equal the eager engine, by mode",
    "churned_prefix_store": "12 calls filling and evicting a 16-block prefix store: each equals an "
    "engine without the store; the store reuses and evicts",
    "seeded_sampling": "T = 0.8, top-p 0.9 with a seed, proposals repeatable: the same tokens twice, by mode",
    "quantized_graphs": "int8 and int4 weights of a tiny checkpoint, greedy AR and SD: graphs equal "
    "eager (exactness; their speed is quant_speed's)",
    "two_devices": "a tensor-parallel target over two devices and SSD with the draft on a second "
    "GPU: each equals one eager device (skipped with one GPU)",
    "bandwidth_limits": "the bandwidth limit of one decode forward per configuration (bf16 weights "
    "plus the K/V of `kv_tokens` / measured bandwidth), beside step_times' graph step where it has one",
    "exact_traced": "as exact_cuda_graphs with SSDLOCAL_GRAPHS=trace (the CPU twin of CUDA graphs) "
    "on this device; run last",
}


def _heading(step: str, title: str | None = None) -> list[str]:
    return [f"## {title or step}", "", f"_{MEASURES[step]}_", ""]


def render(data: dict) -> str:
    lines = ["# ssdlocal GPU acceptance", ""]
    env = data["steps"].get("environment")
    if env:
        lines += _heading("environment") + [f"- {k}: {v}" for k, v in env.items()] + [""]
    for step in ("exact_cuda_graphs", "exact_traced"):
        rows = data["steps"].get(step)
        if rows:
            lines += [
                *_heading(step),
                "| arch | mode | graphs | calls equal eager | equal AR | equal fresh (no prefix cache) | cached prompt tokens | captured | replays | refused | dropped |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {r['arch']} | {r['mode']} | {r['graphs']} | {r['equal_eager']} | {r['equal_ar']} | "
                f"{r.get('equal_fresh')} | {r.get('cached_tokens')} | "
                f"{r['captured']} | {r['replays']} | {r['refused']} | {r['dropped']} |"
                for r in rows
            ]
            lines.append("")
    cons = data["steps"].get("exact_constrained")
    if isinstance(cons, dict):
        lines += [*_heading("exact_constrained"), f"- {cons.get('skipped')}", ""]
    elif cons:
        lines += [
            *_heading("exact_constrained"),
            "| arch | mode | graphs | equal constrained AR | follows grammar | "
            "grammar ms/token | captured | replays | refused | dropped |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['mode']} | {r['graphs']} | {r['equal_constrained_ar']} | {r['follows_grammar']} | "
            f"{(r['mask_ms_per_token'] or 0):.3f} | {r['captured']} | {r['replays']} | {r['refused']} | "
            f"{r['dropped']} |"
            for r in cons
        ]
        lines.append("")
    timing = data["steps"].get("step_times")
    if timing:
        lines += [
            *_heading("step_times", "step times (bf16, ms, median)"),
            f"| model | weights GB | bandwidth limit | T=1 eager | T=1 graphs | T={K + 1} eager | T={K + 1} graphs | T=1 graphs / limit | T={K + 1} / T=1 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in timing:
            lines.append(
                f"| {r['model']} | {r['weight_gb']:.2f} | {r['limit_ms']:.2f} | {r['T1_eager']:.2f} | "
                f"{r['T1_graphs']:.2f} | {r['TK_eager']:.2f} | {r['TK_graphs']:.2f} | "
                f"{r['T1_graphs'] / r['limit_ms']:.2f}x | {r['TK_graphs'] / r['T1_graphs']:.2f}x |"
            )
        lines.append("")
    prefill = data["steps"].get("prefill")
    if prefill:
        lines += [
            *_heading("prefill", "prefill (2,048-token prompt, one row)"),
            "| model | weights | seconds | tokens/s | TFLOP/s | of measured matmul peak |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['model']} | {r['weights']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['tflops']:.1f} | {r['of_peak']:.0%} |"
            for r in prefill
        ]
        lines.append("")
    for step in SPEED_STEPS:
        lines += _table(step, data["steps"].get(step))
    kernels = data["steps"].get("attention_kernels")
    if kernels:
        lines += _heading("attention_kernels") + [f"- {k}: {v}" for k, v in kernels.items()] + [""]
    for step in MORE_STEPS:
        lines += _table(step, data["steps"].get(step))
    lines += ["## failures", ""] + ([f"- {f}" for f in data["failures"]] or ["none"])
    return "\n".join(lines) + "\n"


SPEED_STEPS = ("attention_spans", "quant_speed")
MORE_STEPS = (
    "family_step_times",
    "hybrid_step_times",
    "hybrid_rounds",
    "head_rounds",
    "host_waits",
    "long_context",
    "churned_prefix_store",
    "seeded_sampling",
    "quantized_graphs",
    "two_devices",
    "bandwidth_limits",
)


def _table(step: str, value) -> list[str]:
    """Markdown for a step of accept_steps.py: a skipped line, a dict, or rows of dicts."""
    if not value:
        return []
    if isinstance(value, dict) and "rows" in value:
        head = {k: v for k, v in value.items() if k != "rows"}
        return [*_heading(step), f"- {head}", ""] + _rows(value["rows"])
    if isinstance(value, dict):
        return _heading(step) + [f"- {k}: {v}" for k, v in value.items()] + [""]
    return _heading(step) + _rows(value)


def _rows(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return (
        ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        + [""]
    )


# --------------------------------------------------------------------------- steps
def environment(device: torch.device) -> dict:
    from gpu_bench import copy_bandwidth

    env = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["bandwidth_gb_s"] = round(copy_bandwidth(device, 2.0) / 1e9, 1)
        env["bf16_matmul_tflops"] = round(matmul_flops(device) / 1e12, 1)
    else:
        env["bandwidth_gb_s"] = round(copy_bandwidth(device, 0.2) / 1e9, 1)
    return env


def _tokens(engine, mode, prompts, new):
    from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    spec = SpecConfig(mode=Mode(mode), k=K, draft=engine.config.spec.draft, backup="jit")
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
    return [o.token_ids for o in done.outputs], {
        **done.stats.get("graphs", {}),
        "_cached": done.stats.get("cached_prompt_tokens", 0),
    }


def exactness(
    dirs: dict, device: str, graph_modes: tuple[str, ...], results: Results, step: str, smoke: bool = False
) -> None:
    """Each arch: a sequence of calls per mode, per graph mode, against eager and AR."""
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
    from ssdlocal.engine import Engine

    rows = []
    calls = CALLS[3:] if smoke else CALLS  # --cpu: the long prompt and the prefix-cache calls
    for arch, draft in list(PAIRS.items())[: 1 if smoke else None]:
        t, d = str(dirs[arch]), str(dirs[draft])
        outs: dict[tuple[str, str], list] = {}
        with Engine(
            EngineConfig(target=ModelSpec(t, device, dtype="float32"), graphs="off", prefix_cache_tokens=0)
        ) as fresh:
            cold = [_tokens(fresh, "ar", prompts, new)[0] for prompts, new in calls]
        for graphs in ("off", *graph_modes):
            config = EngineConfig(
                target=ModelSpec(t, device, dtype="float32"),
                spec=SpecConfig(
                    mode=Mode.SSD, k=K, draft=ModelDraft(ModelSpec(d, device, dtype="float32")), backup="jit"
                ),
                pin_cpus=False,
                graphs=graphs,
            )
            with Engine(config) as engine:
                for mode in ("ar", "sd", "ssd"):
                    counts = {"captured": 0, "replays": 0, "refused": 0, "dropped": 0, "cached_tokens": 0}
                    got = []
                    for prompts, new in calls:
                        tokens, graph_stats = _tokens(engine, mode, prompts, new)
                        got.append(tokens)
                        counts["cached_tokens"] += graph_stats.pop("_cached", 0)
                        for model in graph_stats.values():
                            for key in counts:
                                counts[key] += model.get(key, 0)
                    outs[(graphs, mode)] = (got, counts)
        for graphs in graph_modes:
            for mode in ("ar", "sd", "ssd"):
                got, counts = outs[(graphs, mode)]
                row = {
                    "arch": arch,
                    "mode": mode,
                    "graphs": graphs,
                    "equal_eager": got == outs[("off", mode)][0],
                    "equal_ar": got == outs[("off", "ar")][0],
                    "equal_fresh": got == cold,
                    **counts,
                }
                rows.append(row)
                if not (row["equal_eager"] and row["equal_ar"] and row["equal_fresh"]):
                    results.fail(f"{step}: {arch} {mode} with graphs={graphs} differs")
                if counts["cached_tokens"] == 0:
                    results.fail(f"{step}: {arch} {mode} graphs={graphs}: no call reused a prefix")
                if graphs != "off" and (counts["replays"] == 0 or counts["refused"] or counts["dropped"]):
                    results.fail(f"{step}: {arch} {mode} graphs={graphs}: {counts}")
                results.put(step, rows)
        print(f"  {arch}: done", flush=True)


CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
CONSTRAINED_PROMPTS = ['{"name": "the cat", "tags": ["a"]} {"name": "', "the cat sat on the mat", "fed a bad"]


def constrained(
    dirs: dict, device: str, graph_modes: tuple[str, ...], results: Results, step: str, smoke: bool = False
) -> None:
    """Constrained AR / SD / SSD with graphs equal constrained eager AR; rows follow their grammars."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        results.put(step, {"skipped": "llguidance is not installed (pip install llguidance)"})
        return
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine
    from ssdlocal.grammar.compiler import GrammarCompiler

    params = SamplingParams(max_new_tokens=24)
    rows = []
    for arch in ("llama",) if smoke else ("llama", "qwen2"):
        t, d = str(dirs[arch]), str(dirs[PAIRS[arch]])
        outs: dict[tuple[str, str], tuple] = {}
        for graphs in ("off", *graph_modes):
            draft = ModelDraft(ModelSpec(d, device, dtype="float32"))
            config = EngineConfig(
                target=ModelSpec(t, device, dtype="float32"),
                spec=SpecConfig(mode=Mode.SSD, k=K, draft=draft, backup="jit"),
                pin_cpus=False,
                graphs=graphs,
            )
            with Engine(config) as engine:
                compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
                grammars = [compiler.json_schema(CONSTRAINED_SCHEMA), None, compiler.regex(r"[a-f]+( [a-f]+)*")]
                for mode in ("ar", "sd", "ssd"):
                    spec = SpecConfig(mode=Mode(mode), k=K, draft=draft, backup="jit")
                    done = [
                        e
                        for e in engine.generate(CONSTRAINED_PROMPTS, params, spec=spec, grammars=grammars)
                        if isinstance(e, DoneEvent)
                    ][0]
                    tokens = [o.token_ids for o in done.outputs]
                    follows = all(
                        g is None or g.matcher().consume_tokens([x for x in tok if x not in engine.eos_ids])
                        for g, tok in zip(grammars, tokens)
                    )
                    counts = {"captured": 0, "replays": 0, "refused": 0, "dropped": 0}
                    for model in (done.stats.get("graphs") or {}).values():
                        for key in counts:
                            counts[key] += model.get(key, 0)
                    outs[(graphs, mode)] = (tokens, counts, follows, done.stats.get("mask_ms_per_token"))
        for graphs in graph_modes:
            for mode in ("ar", "sd", "ssd"):
                tokens, counts, follows, mask_ms = outs[(graphs, mode)]
                row = {
                    "arch": arch,
                    "mode": mode,
                    "graphs": graphs,
                    "equal_constrained_ar": tokens == outs[("off", "ar")][0],
                    "follows_grammar": follows,
                    "mask_ms_per_token": mask_ms,
                    **counts,
                }
                rows.append(row)
                if not (row["equal_constrained_ar"] and follows):
                    results.fail(f"{step}: {arch} {mode} with graphs={graphs} differs from constrained AR")
                if graphs != "off" and (counts["replays"] == 0 or counts["refused"] or counts["dropped"]):
                    results.fail(f"{step}: {arch} {mode} graphs={graphs}: {counts}")
                results.put(step, rows)
        print(f"  {arch}: done", flush=True)


def step_times(device: torch.device, bandwidth: float, models: tuple[str, ...], results: Results) -> None:
    from gpu_bench import prefilled, random_model, step_ms, weight_bytes

    rows = []
    for name in models:
        loaded = random_model(name, device, torch.bfloat16)
        row = {
            "model": name,
            "weight_gb": weight_bytes(loaded) / 1e9,
            "limit_ms": weight_bytes(loaded) / bandwidth * 1e3,
        }
        for label, mode in (("eager", "off"), ("graphs", "auto")):
            runner = prefilled(loaded, mode, 512)
            row[f"T1_{label}"] = step_ms(runner, 1, 20)
            row[f"TK_{label}"] = step_ms(runner, K + 1, 20)
            if label == "graphs":
                stats = runner.graphs.stats if runner.graphs is not None else None
                row["graphs"] = stats.as_dict() if stats is not None else "none"
                if stats is None or stats.refused or stats.dropped or not stats.replays:
                    results.fail(f"step_times: {name} bf16 graphs refused, dropped or never replayed: {row['graphs']}")
            del runner
        rows.append(row)
        results.put("step_times", rows)
        del loaded
        torch.cuda.empty_cache() if device.type == "cuda" else None
        print(f"  {name}: {row}", flush=True)


def prefill_speed(device: torch.device, peak_flops: float, models: tuple[str, ...], results: Results) -> None:
    """A 2,048-token prompt read cold (chunks layer by layer), bf16 and int4 weights."""
    from gpu_bench import random_model, sync

    from ssdlocal.backends.torch.quant_apply import quantize_model
    from ssdlocal.backends.torch.runner import TorchRunner

    rows, tokens = [], 2048
    for name in models:
        for weights in ("bf16", "int4"):
            loaded = random_model(name, device, torch.bfloat16)
            if weights == "int4":
                quantize_model(loaded.model, "int4")
            params = sum(p.numel() for n, p in loaded.model.named_parameters() if "embed" not in n)
            runner = TorchRunner(loaded, graphs="off")
            best = float("inf")
            for _ in range(3):
                runner.reset(1, tokens + 16)
                sync(device)
                t0 = time.perf_counter()
                runner.feed([[1 + i % (loaded.args.vocab_size - 1) for i in range(tokens)]], "last")
                sync(device)
                best = min(best, time.perf_counter() - t0)
            flops = 2 * params * tokens / best
            rows.append(
                {
                    "model": name,
                    "weights": weights,
                    "seconds": best,
                    "tokens_per_s": tokens / best,
                    "tflops": flops / 1e12,
                    "of_peak": flops / peak_flops,
                }
            )
            results.put("prefill", rows)
            print(f"  {rows[-1]}", flush=True)
            del runner, loaded
            torch.cuda.empty_cache() if device.type == "cuda" else None


def matmul_flops(device: torch.device) -> float:
    """Measured bf16 matmul FLOP/s (8192^3, median of 10)."""
    from gpu_bench import timed

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = timed(lambda: a @ a, device, 10)
    return 2 * 8192**3 / (ms / 1e3)


def attention_kernels(device: torch.device, results: Results) -> None:
    """Profile one masked decode step and one fresh prefill of a GQA model; ask torch too."""
    from gpu_bench import prefilled, random_model

    from ssdlocal.backends.torch.attention import AttentionMask

    loaded = random_model("qwen2.5-1.5b", device, torch.bfloat16)
    runner = prefilled(loaded, "off", 512)
    found = {}
    for label, fn in (
        ("decode_T1", lambda: runner.step(torch.ones(1, 1, dtype=torch.long, device=device))),
        ("verify_T5", lambda: runner.step(torch.ones(1, K + 1, dtype=torch.long, device=device))),
        ("prefill", lambda: (runner.reset(1, 1024), runner.feed([list(range(1, 300))], "last"))),
    ):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        names = {
            e.name
            for e in prof.events()
            if any(w in e.name.lower() for w in ("fmha", "flash", "attention", "attn", "softmax"))
        }
        found[label] = sorted(names)[:6] or ["no attention-like kernel seen"]
    a = loaded.args
    q = torch.zeros(
        1, a.num_kv_heads, (a.num_heads // a.num_kv_heads) * (K + 1), a.head_dim, dtype=torch.bfloat16, device=device
    )
    keys = torch.zeros(1, a.num_kv_heads, 1024, a.head_dim, dtype=torch.bfloat16, device=device)
    mask = AttentionMask.build(
        torch.ones(1, K + 1, 1024, dtype=torch.bool, device=device), a.num_heads // a.num_kv_heads, torch.bfloat16
    )
    params = torch.backends.cuda.SDPAParams(q, keys, keys, mask.tensor, 0.0, False, False)
    found["can_use_efficient(folded verify)"] = torch.backends.cuda.can_use_efficient_attention(params, True)
    found["can_use_flash(folded verify)"] = torch.backends.cuda.can_use_flash_attention(params, False)
    results.put("attention_kernels", found)


def more_steps(dirs: dict, device: torch.device, graph_mode: str, results: Results, tmp: Path) -> list:
    """The steps of accept_steps.py, as (name, run) pairs."""
    import accept_steps as more

    where = str(device)
    smoke = ("ar", "sd") if device.type == "cpu" else ("ar", "sd", "ssd")  # --cpu: no SSD worker to start

    def limits() -> None:
        from gpu_bench import copy_bandwidth

        env = results.data["steps"].get("environment", {})
        bandwidth = env["bandwidth_gb_s"] * 1e9 if "bandwidth_gb_s" in env else copy_bandwidth(device, 0.2)
        measured = {r["model"]: r["T1_graphs"] for r in results.data["steps"].get("step_times") or []}
        more.bandwidth_table(bandwidth, results, measured)

    def families() -> None:
        from accept_families import family_step_times
        from gpu_bench import copy_bandwidth

        env = results.data["steps"].get("environment", {})
        bandwidth = env["bandwidth_gb_s"] * 1e9 if "bandwidth_gb_s" in env else copy_bandwidth(device, 0.2)
        family_step_times(device, bandwidth, graph_mode, results, smoke=device.type == "cpu")

    def hybrid() -> None:
        from accept_hybrid import hybrid_step_times
        from gpu_bench import copy_bandwidth

        env = results.data["steps"].get("environment", {})
        bandwidth = env["bandwidth_gb_s"] * 1e9 if "bandwidth_gb_s" in env else copy_bandwidth(device, 0.2)
        hybrid_step_times(device, bandwidth, graph_mode, results, smoke=device.type == "cpu")

    def rounds(which: str) -> None:
        import accept_rounds

        getattr(accept_rounds, which)(tmp / "tokenizer", tmp, device, graph_mode, results)

    return [
        ("family_step_times", families),
        ("hybrid_step_times", hybrid),
        ("hybrid_rounds", lambda: rounds("hybrid_rounds")),
        ("head_rounds", lambda: rounds("head_rounds")),
        ("host_waits", lambda: more.host_waits(dirs, where, results)),
        ("long_context", lambda: more.long_context(dirs, where, graph_mode, results, tmp, modes=smoke)),
        ("churned_prefix_store", lambda: more.churned_store(dirs, where, graph_mode, results)),
        ("seeded_sampling", lambda: more.seeded_sampling(dirs, where, graph_mode, results)),
        ("quantized_graphs", lambda: more.quantized_graphs(dirs, where, graph_mode, results)),
        ("two_devices", lambda: more.two_devices(dirs, where, graph_mode, results, modes=smoke)),
        ("bandwidth_limits", limits),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-accept-out")
    ap.add_argument("--cpu", action="store_true", help="run the steps on the CPU (checks the script)")
    ap.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b", help="timing shapes (gpu_bench.py SHAPES)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="steps not started by then are failures (default: 480 on a GPU, none with --cpu)",
    )
    ap.add_argument(
        "--steps",
        default=None,
        help="run only these steps, comma-separated (environment always runs; default: all)",
    )
    args = ap.parse_args()
    results = Results(Path(args.out))
    budget_s = args.budget_s if args.budget_s is not None else (float("inf") if args.cpu else 480.0)
    device = torch.device("cpu" if args.cpu else "cuda:0")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --cpu to check the script)")
        return 2
    t0 = time.perf_counter()
    steps = [
        ("environment", lambda: results.put("environment", environment(device))),
    ]
    from support.tiny_models import make_tiny_suite

    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_tiny_suite(Path(tmp))
        graph_modes = ("trace",) if args.cpu else ("auto",)
        steps.append(
            (
                "exact_cuda_graphs",
                lambda: exactness(dirs, str(device), graph_modes, results, "exact_cuda_graphs", smoke=args.cpu),
            )
        )
        steps.append(
            (
                "exact_constrained",
                lambda: constrained(dirs, str(device), graph_modes, results, "exact_constrained", smoke=args.cpu),
            )
        )
        speed_models = ("tiny-target",) if args.cpu else tuple(args.models.split(","))

        def bandwidth() -> float:
            return results.data["steps"]["environment"]["bandwidth_gb_s"] * 1e9

        if not args.cpu:
            steps.append(
                (
                    "step_times",
                    lambda: step_times(
                        device,
                        results.data["steps"]["environment"]["bandwidth_gb_s"] * 1e9,
                        tuple(args.models.split(",")),
                        results,
                    ),
                )
            )
            steps.append(
                (
                    "prefill",
                    lambda: prefill_speed(
                        device,
                        results.data["steps"]["environment"]["bf16_matmul_tflops"] * 1e12,
                        tuple(args.models.split(",")),
                        results,
                    ),
                )
            )
            steps.append(("attention_kernels", lambda: attention_kernels(device, results)))
        steps.append(("attention_spans", lambda: speed.attention_spans(speed_models[0], device, bandwidth(), results)))
        steps.append(("quant_speed", lambda: speed.quant_speed(speed_models, device, bandwidth(), results)))
        steps += more_steps(dirs, device, graph_modes[0], results, Path(tmp))
        if not args.cpu:  # last: what it checks the CUDA graphs' rows checked already, slower

            def traced() -> None:
                exactness(dirs, str(device), ("trace",), results, "exact_traced")

            steps.append(("exact_traced", traced))
        chosen = set(args.steps.split(",")) | {"environment"} if args.steps else {name for name, _ in steps}
        unknown = chosen - {name for name, _ in steps}
        if unknown:
            print(f"unknown steps: {', '.join(sorted(unknown))}; steps: {', '.join(name for name, _ in steps)}")
            return 2
        for name, run in steps:
            if name not in chosen:
                continue
            if time.perf_counter() - t0 > budget_s:
                results.fail(f"{name}: not run, past the {budget_s:.0f} s budget")
                continue
            print(f"[{time.perf_counter() - t0:5.0f} s] {name}", flush=True)
            try:
                run()
            except Exception as exc:  # a step that breaks must not hide the others' results
                results.fail(f"{name} raised {type(exc).__name__}: {exc}")
                traceback.print_exc()
    results.data["wall_s"] = round(time.perf_counter() - t0, 1)
    results.write()
    print(render(results.data))
    return 1 if results.data["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("SSDLOCAL_GRAPHS_STRICT", "1")  # audit failures are failures here
    sys.exit(main())
