"""Benchmark outputs: results.json (environment, settings, records, aggregates,
projections), results.md (Markdown table) and results.png (matplotlib, Agg backend; skipped
without it).

`build_results` is the one place the JSON document is assembled; the writers only
render it. Nothing here prints.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, replace
from pathlib import Path

from ssdlocal.bench.aggregate import aggregate_all, projection_inputs, session_turns
from ssdlocal.bench.check import SHAPE_TIE
from ssdlocal.speculation.projection import DEFAULT_RATIOS, project
from ssdlocal.bench.run import BenchRun
from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import Quantization

SCHEMA_VERSION = 1


def environment() -> dict:
    """Hardware (CPU model, cores, RAM, GPUs) and library versions."""
    import torch
    import transformers

    from ssdlocal import __version__

    from ssdlocal.core.cpu import cpu_flags, cpu_model

    cpu = cpu_model() or platform.machine()
    flags = cpu_flags()
    ram = None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "hardware": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "usable_cores": usable,
            # what torch's CPU kernels use, and whether bf16 matmuls are native (without
            # it a bf16 forward of K+1 tokens costs several times one token's)
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}),
            "ram_gib": round(ram, 1) if ram else None,
            "gpus": gpus,
            "platform": platform.platform(),
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "versions": {
            "ssdlocal": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
    }


def build_results(run: BenchRun, *, with_projection: bool, ratios=DEFAULT_RATIOS, env: dict | None = None) -> dict:
    """The results.json document."""
    aggs = aggregate_all(run.records, run.systems, run.exactness)
    doc = {
        "schema": SCHEMA_VERSION,
        **(env if env is not None else environment()),
        "settings": settings_record(run),
        "prompts": [asdict(p) for p in run.prompts],
        "batches": run.batches,
        "systems": run.systems,
        "skipped": run.skipped,
        "exactness": run.exactness or {s: {"status": "n/a (temperature > 0 or no AR run)"} for s in run.systems},
        "aggregates": aggs,
        "sessions": session_turns(run.records, run.systems),
        "records": run.records,
        "wall_s": run.wall_s,
    }
    if with_projection:
        k = run.config.spec.k
        bytes_ratio, verify_cost = weight_reads(run.config, k)
        inputs = replace(projection_inputs(aggs, k), bytes_ratio=bytes_ratio, verify_cost=verify_cost)
        doc["projections"] = project(inputs, ratios)
    return doc


def weight_reads(config, k: int) -> tuple[float | None, float]:
    """(weight bytes a draft step reads over a target step's, a K+1-token verification's
    over a target step's) of the run's model files as loaded (weights/size.step_bytes, from
    headers: a mixture of experts reads only the experts its tokens use); (None, 1.0) where
    the files cannot tell (the target is no local model file), None for the ratio without
    a draft model."""
    from ssdlocal.core.errors import SSDLocalError
    from ssdlocal.weights.formats.quantized import resolve_scheme
    from ssdlocal.weights.size import step_bytes

    def reads(spec, tokens: int) -> int:
        none = spec.quantization is Quantization.NONE
        scheme = Quantization.NONE if none else resolve_scheme(spec.path, spec.quantization)
        return step_bytes(spec.path, scheme, spec.dtype, tokens)

    try:
        one = reads(config.target, 1)
        verify = reads(config.target, k + 1) / one
    except (SSDLocalError, OSError, ValueError):
        return None, 1.0
    draft = config.spec.draft.model
    try:
        return (reads(draft, 1) / one if draft is not None else None), verify
    except (SSDLocalError, OSError, ValueError):
        return None, verify


def settings_record(run: BenchRun) -> dict:
    """The flat "settings" object of results.json: what was asked, in one place."""
    config, spec, params, s = run.config, run.config.spec, run.params, run.settings
    return {
        "modes": list(s.modes),
        "peers": list(s.peers),
        "k": spec.k,
        "fan_out": spec.fan_out,
        "fan_out_miss": spec.fan_out_miss,
        "backup": spec.backup,
        "saguaro_c": spec.saguaro_c,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "batch_size": s.batch_size,
        "max_new_tokens": params.max_new_tokens,
        "repeats": s.repeats,
        "chat": s.chat,
        "ignore_eos": params.ignore_eos,
        "dtype": config.target.dtype,
        "quantization": run.quantization or config.target.quantization,
        "draft_quantization": config.draft_model.quantization if config.draft_model else None,
        "target_device": config.target.device,
        "draft_device": config.draft_model.device if config.draft_model else None,
        "pin_cpus": config.pin_cpus,
        "warmup_tokens": s.warmup_tokens,
        "gguf_target": s.gguf_target,
        "gguf_draft": s.gguf_draft,
        "target_devices": list(config.target_devices),
        "target": run.target,
        "draft": run.draft,
        "n_prompts": len(run.prompts),
        "target_backend": config.target.backend.value,
        "batch_invariant": config.target.batch_invariant,
    }


def exactness_note(doc: dict) -> str | None:
    """A line for under the table when systems failed exactness on a llama.cpp target
    without --batch-invariant and every divergence listed is a near-tie within what
    llama.cpp's call widths move a logit (SHAPE_TIE); None otherwise (a larger margin is
    no rounding, and the table's FAIL stands alone)."""
    settings = doc["settings"]
    if settings.get("target_backend") != BackendName.LLAMACPP.value or settings.get("batch_invariant"):
        return None
    failed = [ex for ex in doc["exactness"].values() if ex.get("status") == "FAIL"]
    margins = [d.get("margin") for ex in failed for d in ex.get("divergences", [])]
    if not margins or any(m is None or m >= SHAPE_TIE for m in margins):
        return None
    return (
        f"note: every divergence is a near-tie (target margins {min(margins):.3f}-{max(margins):.3f}, "
        f"under {SHAPE_TIE}): llama.cpp computes a token's logits slightly differently in a multi-token "
        "call than in a one-token step, so speculation can part from AR where two tokens almost tie. "
        "--batch-invariant makes greedy AR, SD and SSD agree bit for bit (one request at a time; "
        "steps cost more and the target keeps no prefix cache)."
    )


def plotting_available() -> bool:
    """Whether matplotlib (the `bench` extra) can draw results.png."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_all(doc: dict, out_dir: Path) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib installed) results.png into
    out_dir; return the paths written ("png" absent without matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["md"].write_text(markdown(doc))
    if plotting_available():
        paths["png"] = out_dir / "results.png"
        write_png(doc, paths["png"])
    return paths


def _f(value, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if value is None else fmt.format(value)


def summary_rows(doc: dict) -> list[list[str]]:
    """Table rows shared by Markdown and the terminal: one per system."""
    rows = []
    for name, a in doc["aggregates"].items():
        rate = _f(a["tokens_per_s"])
        if not a["valid"]:
            rate = f"FAIL ({rate} not counted)"
        rows.append(
            [
                name,
                rate,
                _f(a["tokens_per_s_mean"]),
                "–" if a["ttft_s"] is None else f"{a['ttft_s'] * 1e3:.0f}",
                _f(a.get("acceptance_rate"), "{:.0%}"),
                _f(a.get("mean_accepted_len")),
                _f(a.get("cache_hit_rate"), "{:.0%}"),
                _f(a.get("draft_ms_per_round"), "{:.1f}"),
                _f(a.get("verify_ms_per_round"), "{:.1f}"),
                _f(a["speedup_vs_ar"], "{:.2f}×"),
                _f(a["speedup_vs_sd"], "{:.2f}×"),
                _exact_cell(doc["exactness"].get(name, {})),
            ]
        )
    return rows


HEADERS = [
    "system",
    "tok/s",
    "tok/s mean",
    "TTFT ms",
    "accept",
    "tok/round",
    "cache hit",
    "draft ms/rnd",
    "verify ms/rnd",
    "vs AR",
    "vs SD",
    "exact",
]


SESSION_HEADERS = ["system", "turn", "TTFT s", "vs turn 1", "prompt tok", "cached", "prefill tok/s", "end-to-end s"]


def session_rows(doc: dict) -> list[list[str]]:
    """The session workload's table: one row per system and turn (empty without sessions)."""
    first = {r["system"]: r["ttft_s"] for r in doc.get("sessions", []) if r["turn"] == 1}
    rows = []
    for r in doc.get("sessions", []):
        base = first.get(r["system"])
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else None
        rows.append(
            [
                r["system"],
                str(r["turn"]),
                _f(r["ttft_s"]),
                _f(r["ttft_s"] / base if base else None, "{:.2f}×"),
                f"{r['prompt_tokens']:.0f}",
                _f(share, "{:.0%}"),
                _f(r["prefill_tokens_per_s"], "{:.0f}"),
                _f(r["e2e_s"]),
            ]
        )
    return rows


def _exact_cell(ex: dict) -> str:
    status = ex.get("status", "n/a")
    if status != "FAIL":
        return status
    first = ex["divergences"][0]
    margin = f", margin {first['margin']:.3f}" if "margin" in first else ""
    if first.get("near_tie"):
        margin += ", near-tie: rounding?"
    return f"FAIL {ex['mismatched_rows']}/{ex['rows']} (first at {first['index']}{margin})"


def markdown(doc: dict) -> str:
    s, hw, v = doc["settings"], doc["hardware"], doc["versions"]
    lines = [
        "# ssdlocal bench",
        "",
        f"- target: `{s['target']}`  draft: `{s['draft']}`",
        (
            f"- {s['n_prompts']} prompts, batch {s['batch_size']}, max {s['max_new_tokens']} new tokens, "
            f"K={s['k']}, temperature {s['temperature']}, {s['dtype']}, weights {s.get('quantization')}, "
            f"repeats {s['repeats']}, chat {s['chat']}"
        ),
        f"- {hw['cpu']} ({hw['usable_cores']} usable cores, {hw.get('cpu_isa')}, native bf16: "
        f"{'yes' if hw.get('cpu_bf16') else 'no'}), RAM {hw['ram_gib']} GiB, GPUs: {', '.join(hw['gpus']) or 'none'}",
        f"- ssdlocal {v['ssdlocal']}, torch {v['torch']}, transformers {v['transformers']}, python {v['python']}",
        "- tok/s = decode tokens / decode time (prefill excluded); TTFT separately",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(doc)]
    note = exactness_note(doc)
    if note:
        lines += ["", note]
    for name, why in doc["skipped"].items():
        lines.append(f"\n- {name}: {why}")
    sessions = session_rows(doc)
    if sessions:
        lines += [
            "",
            "## Sessions (each turn re-sends the conversation; turn 1 starts cold)",
            "",
            "| " + " | ".join(SESSION_HEADERS) + " |",
            "|" + "---|" * len(SESSION_HEADERS),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in sessions]
    proj = doc.get("projections")
    if proj:
        lines += [
            "",
            "## Projection (not measured)",
            "",
            proj["label"],
            "",
            "| draft/target ratio | SD vs AR | SSD vs AR |",
            "|---|---|---|",
        ]
        for r in proj["rows"]:
            tag = " (measured)" if r["measured"] else " (weights read)" if r.get("from_bytes") else ""
            lines.append(
                f"| {r['ratio']:.3f}{tag} | {_f(r['sd_speedup'], '{:.2f}×')} | {_f(r['ssd_speedup'], '{:.2f}×')} |"
            )
    return "\n".join(lines) + "\n"


def write_png(doc: dict, path: Path) -> None:
    """Three panels: tokens/s per system, accepted-length histogram per mode, SSD hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aggs = doc["aggregates"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(aggs)
    rates = [aggs[n]["tokens_per_s"] or 0.0 for n in names]
    colors = ["tab:red" if not aggs[n]["valid"] else "tab:blue" for n in names]
    axes[0].bar(names, rates, color=colors)
    axes[0].set_title("decode tokens/s (red = failed exactness)")
    axes[0].set_ylabel("tokens/s")
    hists = {n: a["accepted_len_hist"] for n, a in aggs.items() if a.get("accepted_len_hist")}
    if hists:
        width = 0.8 / len(hists)
        for i, (n, h) in enumerate(hists.items()):
            total = sum(h) or 1
            axes[1].bar([x + i * width for x in range(len(h))], [c / total for c in h], width, label=n)
        axes[1].legend()
    axes[1].set_title("accepted draft tokens per round")
    axes[1].set_xlabel("accepted")
    ssd = aggs.get("ssd") or {}
    if ssd.get("cache_hit_rate") is not None:
        hit = ssd["cache_hit_rate"]
        axes[2].bar(["hit", "miss"], [hit, 1 - hit], color=["tab:green", "tab:gray"])
        axes[2].set_ylim(0, 1)
    else:
        axes[2].text(0.5, 0.5, "no SSD run", ha="center", va="center")
    axes[2].set_title("SSD speculation cache")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
