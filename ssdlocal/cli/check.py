"""`ssdlocal check`: run the pair greedily in AR, SD and SSD and report any divergence.

Wiring and rendering only; the run itself is ssdlocal.bench.check.run_check.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ssdlocal.cli import options as o
from ssdlocal.cli.resolve import ModelOptions, SpecOptions, engine_config, gather
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.errors import UsageError

out = Console(soft_wrap=True)


def check(
    pair: Annotated[
        str | None, typer.Option(help="Registry pair to check (must be pulled).")
    ] = None,
    target: Annotated[str | None, typer.Option(help="Target checkpoint dir or .gguf file.")] = None,
    draft: o.Draft = None,
    dtype: Annotated[
        str, typer.Option(help="float32 (must be identical) | bfloat16 | float16")
    ] = "float32",
    quantization: o.Quantization = "auto",
    draft_quantization: o.DraftQuantization = None,
    max_new_tokens: o.FixedNewTokens = 32,
    k: o.K = 4,
    fan_out: o.FanOut = None,
    fan_out_miss: o.FanOutMiss = None,
    backup: o.Backup = "auto",
    target_device: o.TargetDevice = "auto",
    draft_device: o.DraftDevice = "auto",
    target_devices: o.TargetDevices = None,
    target_backend: o.TargetBackend = "auto",
    draft_backend: o.DraftBackend = "auto",
    cuda_graphs: o.CudaGraphs = True,
    chat: o.Chat = False,
    as_json: o.Json = False,
) -> None:
    """Run the pair greedily in AR, SD and SSD and verify the outputs are identical."""
    from ssdlocal.bench.check import NEAR_TIE, run_check
    from ssdlocal.cli.render import err_console

    if pair is not None and (target is not None or draft is not None):
        raise UsageError(
            "--pair cannot be combined with --target/--draft",
            "pass either --pair NAME or both paths",
        )
    if (target is None) != (draft is None) and pair is None:
        raise UsageError("--target and --draft go together", "pass both, or --pair NAME")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    values = locals()
    spec_opts = SpecOptions(mode="ssd", k=k, fan_out=fan_out, fan_out_miss=fan_out_miss, backup=backup)
    config = engine_config(gather(ModelOptions, values), spec_opts)
    warnings: tuple[str, ...] = ()
    if config.draft_model is not None:
        from ssdlocal.weights.compat import check_paths

        warnings = check_paths(config.target.path, config.draft_model.path).warnings  # before weights load
    with err_console.status("loading ...", spinner="dots") as status:
        report = run_check(
            config, params=params, chat=chat, on_mode=lambda m: status.update(f"running {m} ...")
        )
    report = dataclasses.replace(report, warnings=warnings)
    if as_json:
        sys.stdout.write(
            json.dumps({**dataclasses.asdict(report), "identical": report.identical}) + "\n"
        )
    else:
        _render_check(report, NEAR_TIE)
    if not report.identical:
        raise typer.Exit(1)


def _render_check(report, near_tie: float) -> None:
    table = Table(title=f"greedy AR / SD / SSD on {len(report.prompts)} prompts ({report.dtype})")
    for col in ("mode", "tokens", "tok/s", "acceptance", "identical to AR"):
        table.add_column(col)
    diverged = {d.mode for d in report.divergences}
    for run in report.runs:
        same = (
            "reference"
            if run.mode == "ar"
            else ("[red]no[/red]" if run.mode in diverged else "[green]yes[/green]")
        )
        acc = "-" if run.acceptance_rate is None else f"{run.acceptance_rate:.0%}"
        table.add_row(run.mode, str(run.tokens), f"{run.tokens_per_s:.2f}", acc, same)
    out.print(table)
    for w in report.warnings:
        out.print(f"[dim]note: {w}[/dim]")
    for d in report.divergences:
        margin = "unknown" if d.margin is None else f"{d.margin:.4f}"
        if report.dtype == "float32":
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
        "[bold green]identical[/bold green]: SD and SSD reproduce AR token for token"
        if report.identical
        else "[bold red]NOT identical[/bold red]"
    )
