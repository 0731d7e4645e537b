"""`ssdlocal bench`: options -> BenchSettings -> run_bench -> results files + summary.

Wiring and terminal rendering only (Rich progress on stderr, summary table on stdout);
the measuring lives in ssdlocal/bench/.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from .config import parse_fan_out
from .errors import UsageError


def _csv(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def bench(
    target: Annotated[
        str | None,
        typer.Option(help="Target checkpoint. Default: the offline Qwen2.5-Coder 1.5B."),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(help="Draft checkpoint. Default: the offline Qwen2.5-Coder 0.5B."),
    ] = None,
    modes: Annotated[
        str, typer.Option(help="Our modes to run, comma-separated: ar,sd,ssd.")
    ] = "ar,sd,ssd",
    peers: Annotated[
        str,
        typer.Option(
            help="Peers on the same weights: hf,hf-assisted,llamacpp,llamacpp-assisted (empty = none)."
        ),
    ] = "",
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="JSONL of {id, kind, prompt} or plain text, one prompt per line. Default: the built-in set."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="Use the first N prompts (round-robin over kinds).")
    ] = None,
    k: Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K).")] = 4,
    fan_out: Annotated[
        str | None, typer.Option(help="SSD fan-out after a hit, e.g. 3,3,2,2,1, or auto.")
    ] = None,
    fan_out_miss: Annotated[
        str | None, typer.Option(help="SSD fan-out after a miss, or auto.")
    ] = None,
    backup: Annotated[
        str, typer.Option(help="SSD backup on a miss: auto | jit | ngram | none")
    ] = "auto",
    saguaro_c: Annotated[float, typer.Option(help="Saguaro sampling constant C in (0, 1].")] = 1.0,
    temperature: Annotated[
        float, typer.Option(help="0 = greedy (exactness is checked against AR).")
    ] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Prompts per generate call.")] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 128,
    repeats: Annotated[int, typer.Option(help="Times to run the whole prompt set.")] = 1,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past end-of-sequence.")] = False,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "bfloat16",
    target_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    draft_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    target_devices: Annotated[
        str | None,
        typer.Option(
            help="Tensor-parallel target over these devices, e.g. cuda:0-3 "
            "(overrides --target-device)."
        ),
    ] = None,
    chat: Annotated[
        bool, typer.Option(help="Wrap each prompt in the model's chat template.")
    ] = True,
    out: Annotated[
        Path | None, typer.Option(help="Output directory. Default: bench-out/<timestamp>.")
    ] = None,
    project: Annotated[
        bool,
        typer.Option(
            "--project", help="Also project SD/SSD speedups at other draft/target latency ratios."
        ),
    ] = False,
    gguf_target: Annotated[
        str | None, typer.Option(help="GGUF target for the llama.cpp peers.")
    ] = None,
    gguf_draft: Annotated[
        str | None, typer.Option(help="GGUF draft for llamacpp-assisted.")
    ] = None,
    pin: Annotated[
        bool, typer.Option(hidden=True, help="Pin SSD target/draft to disjoint CPUs.")
    ] = True,
) -> None:
    """Benchmark AR, SD and SSD (and peers) on the same prompts; write JSON, Markdown and a plot."""
    from .bench.prompts import load_prompts, select
    from .bench.run import BenchSettings
    from .config import ModelSpec

    tp_devices: tuple[str, ...] = ()
    if target_devices is not None:
        from .parallel.devarg import parse_devices

        tp_devices = parse_devices(target_devices)
        target_device = tp_devices[0]
    settings = BenchSettings(
        modes=_csv(modes), peers=_csv(peers), k=k, fan_out=parse_fan_out(fan_out), fan_out_miss=parse_fan_out(fan_out_miss),
        backup=backup, saguaro_c=saguaro_c, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens, repeats=repeats,
        chat=chat, ignore_eos=ignore_eos, dtype=dtype, target_device=target_device,
        draft_device=draft_device, pin_cpus=pin and os.environ.get("SSDLOCAL_BENCH_NO_PIN") != "1",
        gguf_target=gguf_target, gguf_draft=gguf_draft,
        target_devices=tp_devices if len(tp_devices) > 1 else (),
    )  # fmt: skip
    ModelSpec(target or "default", target_device, dtype)
    ModelSpec(draft or "default", draft_device, dtype)
    chosen = select(load_prompts(prompts), limit)
    if (
        target is not None
        and draft is None
        and (set(settings.modes) - {"ar"} or "hf-assisted" in settings.peers)
    ):
        raise UsageError(
            "--target needs --draft for SD, SSD and hf-assisted",
            "pass --draft PATH or use --modes ar",
        )
    if target is None:
        from .cli import _default_pair

        target, default_draft = _default_pair(dtype)
        draft = draft or default_draft
    out_dir = out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    _run_and_report(str(target), draft, chosen, settings, out_dir, project)


def _run_and_report(target, draft, prompts, settings, out_dir: Path, with_projection: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .bench.report import build_results, write_all
    from .bench.run import run_bench

    try:  # transformers' own warnings and load bars would tear the progress display
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass
    err = Console(stderr=True)
    bars = Progress(
        TextColumn("[bold]{task.fields[stage]}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
    )  # fmt: skip
    with bars:
        task = bars.add_task("", total=None, stage="load")

        def progress(stage: str, done: int, total: int, label: str) -> None:
            bars.update(task, completed=done, total=total, description=label, stage=stage)
            if not err.is_terminal:  # a log file: no live bar, so one plain line per step
                err.print(f"[{done}/{total}] {stage}: {label}", markup=False, highlight=False)

        run = run_bench(target, draft, prompts, settings, progress)
    doc = build_results(run, with_projection=with_projection)
    paths = write_all(doc, out_dir)
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)  # a file or pipe: keep one row per line
    render_summary(doc, console)
    err.print(
        f"[dim]wrote {paths['json']}, {paths['md'].name}, {paths['png'].name} in {run.wall_s:.0f} s[/dim]"
    )


def render_summary(doc: dict, console) -> None:
    """Rich table of per-system aggregates, skipped peers and projections."""
    from rich.table import Table

    from .bench.report import HEADERS, summary_rows

    s = doc["settings"]
    table = Table(
        title=f"ssdlocal bench · {s['n_prompts']} prompts · {s['max_new_tokens']} new tokens · "
        f"K={s['k']} · T={s['temperature']} · {s['dtype']}",
        caption="tok/s = decode tokens / decode time (prefill excluded)",
    )
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("system", "exact") else "right")
    for row in summary_rows(doc):
        style = "red" if row[1].startswith("FAIL") else None
        table.add_row(*row, style=style)
    console.print(table)
    for name, why in doc["skipped"].items():
        console.print(f"{name}: {why}", markup=False)
    proj = doc.get("projections")
    if proj:
        pt = Table(title="projection (not measured)", caption=proj["label"])
        for h in ("draft/target latency ratio", "SD vs AR", "SSD vs AR"):
            pt.add_column(h, justify="right")
        for r in proj["rows"]:
            fmt = lambda v: "–" if v is None else f"{v:.2f}×"
            pt.add_row(
                f"{r['ratio']:.3f}" + (" (measured)" if r["measured"] else ""),
                fmt(r["sd_speedup"]),
                fmt(r["ssd_speedup"]),
            )
        console.print(pt)
