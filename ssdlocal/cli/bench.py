"""`ssdlocal bench`: options -> EngineConfig + BenchSettings -> run_bench -> results + summary;
with `--workload concurrent`: options -> ConcurrentSettings (the model options become
`ssdlocal serve` flags) -> run_concurrent -> results + summary.

Wiring and terminal rendering only (Rich progress on stderr, summary table on stdout);
the measuring lives in ssdlocal/bench/.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Annotated

import typer

from ssdlocal.cli import options as o
from ssdlocal.cli.options import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    model_command,
)
from ssdlocal.cli.resolve import engine_config
from ssdlocal.core.errors import UsageError


def _csv(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


@model_command("bench")
def bench(
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    modes: Annotated[
        str | None,
        typer.Option(
            help="Our systems to run, comma-separated: ar, sd, ssd, suffix (SD with the suffix "
            "drafter, K per round), auto (what `generate` runs by default). Default: ar,sd,ssd; "
            "concurrent: auto (one `ssdlocal serve --mode M` per mode; suffix is not one)."
        ),
    ] = None,
    peers: Annotated[
        str,
        typer.Option(
            help="Peers on the same weights: hf,hf-assisted,llamacpp,llamacpp-assisted (empty = none); "
            "concurrent: llamacpp (llama-cpp-python's own server on the GGUF target)."
        ),
    ] = "",
    workload: Annotated[
        str,
        typer.Option(
            help="sequential: one prompt set, one request at a time (the default); concurrent: "
            "--clients agents, editors (FIM) and chats at once against each server."
        ),
    ] = "sequential",
    clients: Annotated[
        int | None,
        typer.Option(help="Concurrent clients, kinds round-robin: agent (tool calls), fim, chat. Default: 3."),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            help="Requests each concurrent client sends (an agent step, a chat turn, a FIM completion). Default: 3."
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(help="Concurrent clients start no request after this many seconds (default: no limit)."),
    ] = None,
    peer_python: Annotated[
        str | None,
        typer.Option(
            help="Python with llama-cpp-python[server] for the concurrent llamacpp peer. Default: this interpreter."
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="A packaged workload (chat: the default set; edit: code edits and multi-turn "
            "sessions that re-emit code; session: conversations over a source file, timed per turn "
            "with each system's own prefix reuse), or a JSONL file of {id, kind, prompt} (and "
            "session, turn, system), or plain text, one prompt per line."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Use the first N prompts (round-robin over kinds).")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts per generate call.")] = 1,
    repeats: Annotated[int, typer.Option(help="Times to run the whole prompt set.")] = 1,
    chat: o.Chat = True,
    out: o.OutDir = None,
    project: Annotated[
        bool,
        typer.Option("--project", help="Also project SD/SSD speedups at other draft/target latency ratios."),
    ] = False,
    gguf_target: Annotated[
        str | None,
        typer.Option(help="GGUF target for the llama.cpp peers. Default: the GGUF the target came from."),
    ] = None,
    gguf_draft: Annotated[
        str | None,
        typer.Option(help="GGUF draft for llamacpp-assisted. Default: the GGUF the draft came from."),
    ] = None,
    pin: Annotated[bool, typer.Option(hidden=True, help="Pin SSD target/draft to disjoint CPUs.")] = True,
) -> None:
    """Benchmark AR, SD, SSD, the suffix drafter and the default (and peers) on the same prompts;
    write JSON, Markdown and a plot. --workload concurrent: clients at once against servers."""
    from ssdlocal.bench.prompts import load_prompts, select
    from ssdlocal.bench.run import BenchSettings, System

    if workload not in WORKLOADS:
        raise UsageError(f"unknown --workload {workload!r}", f"choose from: {', '.join(WORKLOADS)}")
    if workload == "concurrent":
        not_here = {
            "--prompts": prompts is not None,
            "--limit": limit is not None,
            "--batch-size": batch_size != 1,
            "--repeats": repeats != 1,
            "--project": project,
            "--gguf-draft": gguf_draft is not None,
            "--no-chat": not chat,
            "--no-pin": not pin,
        }
        _refuse(
            [name for name, given in not_here.items() if given],
            "the concurrent workload",
            "its clients send their own conversations; drop them or leave out --workload concurrent",
        )
        concurrent = {
            "clients": 3 if clients is None else clients,
            "duration_s": duration,
            "requests": 3 if requests is None else requests,
            "peer_python": peer_python or sys.executable,
        }
        _bench_concurrent(models, spec, sampling, _csv(modes or "auto"), _csv(peers), gguf_target, concurrent, out)
        return
    only = {"--clients": clients, "--requests": requests, "--duration": duration, "--peer-python": peer_python}
    _refuse(
        [name for name, value in only.items() if value is not None],
        "the sequential workload",
        "add --workload concurrent",
    )
    settings = BenchSettings(
        modes=_csv(modes or "ar,sd,ssd"),
        peers=_csv(peers),
        batch_size=batch_size,
        repeats=repeats,
        chat=chat,
        gguf_target=gguf_target,
        gguf_draft=gguf_draft,
    )
    params = sampling.params()
    # the engine's configured mode: --mode itself for the "auto" system (what generate runs),
    # else the first of sd / ssd, which loads what that mode needs up front
    speculative = [m for m in settings.modes if m.needs_draft]
    if System.AUTO not in settings.modes:
        spec = replace(spec, mode=(speculative[0] if speculative else System.AR).value)
    chosen = select(load_prompts(prompts), limit)
    why = "--target needs --draft for SD, SSD and hf-assisted" if settings.needs_draft else None
    config = engine_config(models, spec, need_draft=why)
    settings = _default_gguf_peers(settings, config)
    pin_cpus = pin and os.environ.get("SSDLOCAL_BENCH_NO_PIN") != "1"
    config = replace(config, pin_cpus=pin_cpus)
    out_dir = out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    _run_and_report(config, chosen, settings, params, out_dir, project)


WORKLOADS = ("sequential", "concurrent")


def _refuse(names: list[str], where: str, hint: str) -> None:
    if names:
        raise UsageError(f"{', '.join(names)} {'does' if len(names) == 1 else 'do'} not apply to {where}", hint)


def serve_flags(models: ModelOptions, spec: SpecOptions) -> tuple[str, ...]:
    """The `ssdlocal serve` flags that reproduce these model and speculation options (those
    left at their defaults are left out; --mode is set per server)."""
    flags: list[str] = []
    for group in (models, spec):
        for f in fields(group):
            value = getattr(group, f.name)
            if f.name == "mode" or value == f.default:
                continue
            info = f.metadata["typer.Option"]  # under Annotated, its first flag sits in `default`
            decls = [d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("--")]
            if isinstance(value, bool):  # declared as "--name/--no-name"
                on, off = decls[0].split("/")
                flags.append(on if value else off)
            else:
                flags += [decls[0] if decls else "--" + f.name.replace("_", "-"), str(value)]
    return tuple(flags)


def _bench_concurrent(models, spec, sampling, modes, peers, gguf_target, concurrent: dict, out) -> None:
    """The concurrent workload's settings from the options, checked before any server starts."""
    from ssdlocal.bench.concurrent import ConcurrentSettings

    params = sampling.params()
    settings = ConcurrentSettings(modes=modes, peers=peers, serve_args=serve_flags(models, spec), **concurrent)
    # the model options are resolved here, so a bad one fails before a server starts
    config = engine_config(models, replace(spec, mode=modes[0] if modes else "auto"))
    if peers and not gguf_target:
        from ssdlocal.weights.cache import gguf_source

        gguf_target = gguf_source(config.target.path)
    settings = replace(settings, gguf_target=gguf_target)
    out_dir = out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    _run_concurrent_and_report(settings, params, out_dir)


def _run_concurrent_and_report(settings, params, out_dir: Path) -> None:
    from ssdlocal.bench.concurrent import run_concurrent
    from ssdlocal.bench.report_concurrent import build_concurrent_results, write_concurrent
    from ssdlocal.cli.render import err_console
    from ssdlocal.server.run import sigterm_exits

    def progress(stage: str, done: int, total: int, label: str) -> None:
        step = f"[{done}/{total}] " if total else ""
        err_console.print(f"{step}{stage}: {label}", markup=False, highlight=False)

    with sigterm_exits():  # SIGTERM too leaves through the servers' `with`: none is left running
        run = run_concurrent(settings, params, out_dir, progress)
    doc = build_concurrent_results(run)
    paths = write_concurrent(doc, out_dir)
    render_concurrent(doc)
    err_console.print(
        f"wrote {paths['json']}, {paths['md'].name} in {run.wall_s:.0f} s", style="dim", markup=False, highlight=False
    )


def render_concurrent(doc: dict) -> None:
    """Rich tables of the concurrent workload: per server, then per server and client kind."""
    from rich.console import Console
    from rich.table import Table

    from ssdlocal.bench.report_concurrent import HEADERS, KIND_HEADERS, concurrent_rows, counting_note, kind_rows

    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    s = doc["settings"]
    for title, headers, rows in (
        (
            f"ssdlocal bench · {s['clients']} concurrent clients · {s['requests_per_client']} requests each · "
            f"{s['max_new_tokens']} new tokens",
            HEADERS,
            concurrent_rows(doc),
        ),
        ("by client", KIND_HEADERS, kind_rows(doc)),
    ):
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="left" if h in ("server", "client") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(counting_note(doc), markup=False, highlight=False)
    for name, why in doc["skipped"].items():
        console.print(f"{name}: {why}", markup=False, highlight=False)


def _default_gguf_peers(settings, config):
    """llama.cpp peers default to the GGUF files the target and draft came from."""
    if not any(p.startswith("llamacpp") for p in settings.peers):
        return settings
    from ssdlocal.weights.cache import gguf_source

    return replace(
        settings,
        gguf_target=settings.gguf_target or gguf_source(config.target.path),
        gguf_draft=settings.gguf_draft or gguf_source(config.draft_model and config.draft_model.path),
    )


def _run_and_report(config, prompts, settings, params, out_dir: Path, with_projection: bool) -> None:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ssdlocal.bench.report import build_results, write_all
    from ssdlocal.bench.run import run_bench

    try:  # transformers' own warnings and load bars would tear the progress display
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass
    err = Console(stderr=True)
    bars = Progress(
        TextColumn("[bold]{task.fields[stage]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
    )
    with bars:
        task = bars.add_task("", total=None, stage="load")

        def progress(stage: str, done: int, total: int, label: str) -> None:
            bars.update(task, completed=done, total=total, description=label, stage=stage)
            if not err.is_terminal:  # a log file: no live bar, so one plain line per step
                err.print(f"[{done}/{total}] {stage}: {label}", markup=False, highlight=False)

        run = run_bench(config, prompts, settings, params, progress)
    doc = build_results(run, with_projection=with_projection)
    paths = write_all(doc, out_dir)
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)  # a file or pipe: keep one row per line
    render_summary(doc, console)
    plot = f", {paths['png'].name}" if "png" in paths else ' (no plot: pip install -e ".[bench]" adds results.png)'
    err.print(
        f"wrote {paths['json']}, {paths['md'].name}{plot} in {run.wall_s:.0f} s",
        style="dim",
        markup=False,
        highlight=False,
    )


def render_summary(doc: dict, console) -> None:
    """Rich table of per-system aggregates, skipped peers and projections."""
    from rich.table import Table

    from ssdlocal.bench.report import HEADERS, exactness_note, summary_rows

    s = doc["settings"]
    table = Table(
        title=f"ssdlocal bench · {s['n_prompts']} prompts · {s['max_new_tokens']} new tokens · "
        f"K={s['k']} · T={s['temperature']} · {s['dtype']} · weights {s.get('quantization')}",
        caption="tok/s = decode tokens / decode time (prefill excluded)",
    )
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("system", "exact") else "right")
    for row in summary_rows(doc):
        style = "red" if row[1].startswith("FAIL") else None
        table.add_row(*row, style=style)
    console.print(table)
    note = exactness_note(doc)
    if note:
        console.print(note, markup=False, highlight=False)
    for name, why in doc["skipped"].items():
        console.print(f"{name}: {why}", markup=False)
    from ssdlocal.bench.report import SESSION_HEADERS, session_rows

    sessions = session_rows(doc)
    if sessions:
        st = Table(title="sessions: each turn re-sends the conversation (turn 1 cold)")
        for h in SESSION_HEADERS:
            st.add_column(h, justify="left" if h == "system" else "right")
        for row in sessions:
            st.add_row(*row)
        console.print(st)
    proj = doc.get("projections")
    if proj:
        pt = Table(title="projection (not measured)", caption=proj["label"])
        for h in ("draft/target latency ratio", "SD vs AR", "SSD vs AR"):
            pt.add_column(h, justify="right")
        for r in proj["rows"]:
            fmt = lambda v: "–" if v is None else f"{v:.2f}×"
            pt.add_row(
                f"{r['ratio']:.3f}"
                + (" (measured)" if r["measured"] else " (weights read)" if r.get("from_bytes") else ""),
                fmt(r["sd_speedup"]),
                fmt(r["ssd_speedup"]),
            )
        console.print(pt)
