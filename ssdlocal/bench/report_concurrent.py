"""The concurrent workload's outputs: results.json (environment, settings, per-server
summaries, per-kind summaries, every request) and results.md (the tables).

`build_concurrent_results` assembles the JSON document once; `concurrent_markdown` and
`concurrent_rows` only render it (the CLI prints the same rows). Nothing here prints.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ssdlocal.bench.concurrent import ConcurrentRun, summaries
from ssdlocal.bench.report import environment

SCHEMA_VERSION = 1
HEADERS = [
    "server",
    "requests",
    "errors",
    "TTFT p50 s",
    "TTFT p95 s",
    "total p50 s",
    "total p95 s",
    "queue p50 s",
    "tok/s",
    "req/s",
    "tool calls",
]
KIND_HEADERS = ["server", "client", "requests", "TTFT p50 s", "TTFT p95 s", "total p50 s", "total p95 s", "tokens"]


def build_concurrent_results(run: ConcurrentRun, env: dict | None = None) -> dict:
    """The results.json document of a concurrent run."""
    s, p = run.settings, run.params
    whole, by_kind = summaries(run)
    return {
        "schema": SCHEMA_VERSION,
        "workload": "concurrent",
        **(env if env is not None else environment()),
        "settings": {
            "modes": list(s.modes),
            "peers": list(s.peers),
            "serve_args": list(s.serve_args),
            "clients": s.clients,
            "requests_per_client": s.requests,
            "duration_s": s.duration_s,
            "peer_python": s.peer_python,
            "gguf_target": s.gguf_target,
            "peer_threads": s.threads,
            "peer_n_ctx": s.n_ctx,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "seed": p.seed,
            "max_new_tokens": p.max_new_tokens,
            "ignore_eos": p.ignore_eos,
        },
        "systems": list(run.timings),
        "skipped": run.skipped,
        "aggregates": whole,
        "by_kind": by_kind,
        "requests": [{"system": name, **asdict(t)} for name, ts in run.timings.items() for t in ts],
        "wall_s": run.wall_s,
    }


def write_concurrent(doc: dict, out_dir: Path) -> dict[str, Path]:
    """Write results.json and results.md into out_dir; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["md"].write_text(concurrent_markdown(doc))
    return paths


def _f(value, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _latencies(a: dict) -> list[str]:
    """The latency columns both tables show: time to first token and total, p50 and p95."""
    return [_f(a[key]) for key in ("ttft_p50_s", "ttft_p95_s", "total_p50_s", "total_p95_s")]


def concurrent_rows(doc: dict) -> list[list[str]]:
    """One row per server (Markdown and the terminal)."""
    return [
        [
            name,
            str(a["requests"]),
            str(a["errors"]),
            *_latencies(a),
            _f(a["queue_p50_s"]),
            _f(a["tokens_per_s"]),
            _f(a["requests_per_s"], "{:.3f}"),
            str(a["tool_calls"]),
        ]
        for name, a in doc["aggregates"].items()
    ]


def kind_rows(doc: dict) -> list[list[str]]:
    """One row per server and client kind."""
    return [
        [
            name,
            kind,
            str(a["requests"]),
            *_latencies(a),
            str(a["completion_tokens"]),
        ]
        for name, kinds in doc["by_kind"].items()
        for kind, a in kinds.items()
    ]


def counting_note(doc: dict) -> str:
    """How each server's tokens were counted (its `usage`, or the text chunks it streamed)."""
    parts = [f"{name}: {'/'.join(a['tokens_from']) or '–'}" for name, a in doc["aggregates"].items()]
    return "tokens counted from " + "; ".join(parts) + " (chunks: one per streamed text piece)"


def concurrent_markdown(doc: dict) -> str:
    s, hw, v = doc["settings"], doc["hardware"], doc["versions"]
    table = lambda headers, rows: [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    lines = [
        "# ssdlocal bench: concurrent clients",
        "",
        f"- {s['clients']} clients (agent, fim, chat round-robin), {s['requests_per_client']} requests each"
        + (f", at most {s['duration_s']:g} s" if s["duration_s"] else "")
        + f"; max {s['max_new_tokens']} new tokens, temperature {s['temperature']}, seed {s['seed']}",
        f"- ssdlocal serve {' '.join(s['serve_args'])} (modes: {', '.join(s['modes']) or 'none'}); "
        f"peers: {', '.join(s['peers']) or 'none'} (GGUF {s['gguf_target']}, {s['peer_threads']} threads)",
        f"- {hw['cpu']} ({hw['usable_cores']} usable cores), RAM {hw['ram_gib']} GiB, GPUs: "
        f"{', '.join(hw['gpus']) or 'none'}; ssdlocal {v['ssdlocal']}, python {v['python']}",
        "- TTFT and total: client clock, per request; tok/s and req/s: over the span from the first "
        "request's start to the last one's end; queue: the server's own figure where it reports one",
        f"- {counting_note(doc)}",
        "",
        *table(HEADERS, concurrent_rows(doc)),
        "",
        "## By client",
        "",
        *table(KIND_HEADERS, kind_rows(doc)),
    ]
    lines += [f"\n- {name}: {why}" for name, why in doc["skipped"].items()]
    return "\n".join(lines) + "\n"
