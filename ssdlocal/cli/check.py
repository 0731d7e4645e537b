"""`ssdlocal check`: run the pair greedily in AR, SD and SSD and report any divergence.

Its model options are every model command's (--pair, --target, --draft alike; the draft is
required); only the dtype defaults to float32, where the outputs must be identical.
Wiring and rendering only; the run itself is ssdlocal.bench.check.run_check.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from ssdlocal.core.config import Mode
from ssdlocal.core.quantization import DType
from ssdlocal.cli import options as o
from ssdlocal.cli.options import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    model_command,
)
from ssdlocal.cli.resolve import engine_config

out = Console(soft_wrap=True)


@model_command("check")
def check(
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    chat: o.Chat = False,
    as_json: o.Json = False,
) -> None:
    """Run the pair greedily in AR, SD and SSD and verify the outputs are identical."""
    from ssdlocal.bench.check import NEAR_TIE, SHAPE_TIE, run_check

    params = sampling.params()  # greedy, a fixed count
    why = "check compares SD and SSD with AR: it needs a draft"
    config = engine_config(models, dataclasses.replace(spec, mode="ssd"), need_draft=why)
    warnings: tuple[str, ...] = ()
    if config.draft_model is not None:
        from ssdlocal.weights.compat import check_paths

        warnings = check_paths(config.target.path, config.draft_model.path).warnings  # before weights load
    from ssdlocal.cli.progress import preparing

    with preparing() as progress:  # loading shows its bars; then the modes, one after another
        modes = ["ar", "sd", "ssd"] if config.spec.draft.ssd else ["ar", "sd"]  # a draft head: SD only

        def on_mode(mode: str) -> None:
            done = modes.index(mode) if mode in modes else 0
            progress(f"comparing {', '.join(m.upper() for m in modes)}", done, len(modes))

        report = run_check(
            config, params=params, chat=chat, on_mode=on_mode, modes=[Mode.parse(m, "mode") for m in modes]
        )
        progress(f"comparing {', '.join(m.upper() for m in modes)}", len(modes), len(modes))
    report = dataclasses.replace(report, warnings=warnings)
    if as_json:
        sys.stdout.write(json.dumps({**dataclasses.asdict(report), "identical": report.identical}) + "\n")
    else:
        _render_check(report, NEAR_TIE, SHAPE_TIE)
    if not report.identical:
        raise typer.Exit(1)


def _render_check(report, near_tie: float, shape_tie: float) -> None:
    names = [run.mode.upper() for run in report.runs]
    table = Table(title=f"greedy {' / '.join(names)} on {len(report.prompts)} prompts ({report.dtype})")
    for col in ("mode", "tokens", "tok/s", "acceptance", "identical to AR"):
        table.add_column(col)
    diverged = {d.mode for d in report.divergences}
    for run in report.runs:
        same = (
            "reference" if run.mode is Mode.AR else ("[red]no[/red]" if run.mode in diverged else "[green]yes[/green]")
        )
        acc = "-" if run.acceptance_rate is None else f"{run.acceptance_rate:.0%}"
        table.add_row(run.mode, str(run.tokens), f"{run.tokens_per_s:.2f}", acc, same)
    out.print(table)
    for w in report.warnings:
        out.print(f"[dim]note: {w}[/dim]")
    for d in report.divergences:
        margin = "unknown" if d.margin is None else f"{d.margin:.4f}"
        if report.shape_rounding and d.margin is not None and d.margin < shape_tie:
            verdict = (
                "llama.cpp's kernels round a verification of several tokens differently from one "
                "token, and the margin is within that: not an algorithm error; --batch-invariant "
                "makes its steps identical bit for bit"
            )
        elif report.dtype is DType.FLOAT32:
            verdict = "fp32 must be identical: this is a bug, please report it"
        elif d.near_tie:
            verdict = f"margin < {near_tie}: a numerical near-tie in {report.dtype}, not an algorithm error"
        else:
            verdict = "the margin is large: likely a bug, please report it (and retry with --dtype float32)"
        out.print(
            f"{d.mode}: prompt {d.prompt_index} diverges from AR at token {d.position} "
            f"(AR {d.ar_token} vs {d.mode} {d.mode_token}); target logit margin {margin}: {verdict}"
        )
    out.print(
        f"[bold green]identical[/bold green]: {' and '.join(names[1:])} reproduce{'s' if len(names) == 2 else ''} AR token for token"
        if report.identical
        else "[bold red]NOT identical[/bold red]"
    )
