"""Typer commands `pairs`, `pull`, `devices` and `check` (registered in cli.py).

Wiring and rendering only: the registry is pairs.py, downloads hub.py, planning
devices.py, the exactness run check.py. Domain errors propagate to cli.main().
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

out = Console(soft_wrap=True)


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def _plan_or_reason(inventory, pair, backend: str) -> tuple[object | None, str]:
    from .devices import PlacementError, plan_placement

    t_gb, d_gb = pair.memory_gb(backend)
    try:
        plan = plan_placement(inventory, t_gb, d_gb, heads=_heads(pair), allow_cpu_target=None)
    except PlacementError as exc:
        return None, exc.message
    return plan, _plan_summary(plan)


def _heads(pair) -> tuple[int, ...]:
    return tuple(h for h in (pair.target.heads, pair.target.kv_heads) if h)


def _plan_short(plan) -> str:
    """`cpu/cpu`, `cuda:0/cuda:1`, `cuda:0-3 TP4/cuda:4`: target / draft."""
    devs = plan.target_devices
    target = (
        devs[0]
        if len(devs) == 1
        else f"{devs[0]}-{devs[-1].split(':')[-1]} TP{plan.tensor_parallel}"
    )
    return f"{target}/{plan.draft_device}"


def _plan_summary(plan) -> str:
    target = ",".join(plan.target_devices)
    tp = f" TP={plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
    return f"target {target}{tp}, draft {plan.draft_device}"


# --------------------------------------------------------------------------- pairs


def pairs(
    backend: Annotated[
        str, typer.Option(help="Which files count as downloaded: torch | llamacpp")
    ] = "torch",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List known target/draft pairs: sizes, backends, downloaded, fits on this machine."""
    from .devices import detect
    from .hub import _check_backend, is_downloaded
    from .pairs import load_pairs

    _check_backend(backend)
    inventory = detect()
    rows = []
    for pair in sorted(load_pairs().values(), key=lambda p: (p.family, p.target.bf16_gb)):
        plan, summary = _plan_or_reason(inventory, pair, backend)
        t_gb, d_gb = pair.memory_gb(backend)
        rows.append(
            {
                "name": pair.name,
                "target": pair.target.label,
                "draft": pair.draft.label,
                "target_gb": t_gb,
                "draft_gb": d_gb,
                "backends": list(pair.backends),
                "source": pair.source,
                "downloaded": is_downloaded(pair, backend) if backend in pair.backends else False,
                "fits": plan is not None,
                "placement": summary,
                "suggested_k": pair.suggested_k,
                "short": _plan_short(plan) if plan is not None else "",
            }
        )
    if as_json:
        sys.stdout.write(
            json.dumps([{k: v for k, v in r.items() if k != "short"} for r in rows]) + "\n"
        )
        return
    memory = "bf16" if backend == "torch" else "GGUF"
    table = Table(title=f"ssdlocal pairs ({backend}; sizes in GB, {memory})")
    table.add_column("name", no_wrap=True)
    for col in ("target", "draft", "backends", "pulled", "fits here"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"],
            _gb(r["target_gb"]),
            _gb(r["draft_gb"]),
            ",".join(r["backends"]),
            "yes" if r["downloaded"] else "no",
            f"[green]yes[/green] {r['short']}" if r["fits"] else "[red]no[/red]",
        )
    out.print(table)
    out.print(
        f"[dim]pull one with `ssdlocal pull NAME`; add your own in {_user_dir()}/NAME.toml[/dim]"
    )


def _user_dir():
    from .pairs import user_dir

    return user_dir()


# --------------------------------------------------------------------------- pull


def pull(
    pair: Annotated[
        str, typer.Argument(help="Pair name (see `ssdlocal pairs`) or a pair .toml file.")
    ],
    backend: Annotated[str, typer.Option(help="torch (safetensors) | llamacpp (GGUF)")] = "torch",
    dtype: Annotated[
        str, typer.Option(help="dtype of the converted checkpoint (offline pair, torch).")
    ] = "bfloat16",
) -> None:
    """Download a pair's target and draft (resumes an interrupted download)."""
    from .clirender import err_console, progress_callback
    from .hub import _check_backend
    from .hub import pull as hub_pull
    from .pairs import get_pair

    _check_backend(backend)
    found = get_pair(pair)
    err_console.print(
        f"pulling {found.name} ({backend}): {found.target.label} + {found.draft.label}"
    )
    with progress_callback() as progress:
        result = hub_pull(found, backend, dtype=dtype, progress=progress)
    for role, path, commit in (
        ("target", result.target, result.commits[0]),
        ("draft", result.draft, result.commits[1]),
    ):
        at = f" (commit {commit})" if commit else ""
        out.print(f"{role}: {path}{at}")
    out.print(f'[dim]use it: ssdlocal generate --pair {found.name} "your prompt"[/dim]')


# --------------------------------------------------------------------------- devices


def devices(
    pair: Annotated[
        str | None, typer.Option(help="Plan placement for this pair (default: the offline pair).")
    ] = None,
    backend: Annotated[
        str, typer.Option(help="torch | llamacpp (memory sizes to plan with)")
    ] = "torch",
    target_gb: Annotated[
        float | None, typer.Option(help="Plan for a target of this many GB instead of a pair.")
    ] = None,
    draft_gb: Annotated[float, typer.Option(help="Draft size in GB with --target-gb.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show GPUs, CPU and RAM, and the placement plan for a pair (refused if it cannot fit)."""
    import dataclasses

    from .devices import detect, plan_placement
    from .hub import OFFLINE_PAIR, _check_backend
    from .pairs import get_pair
    from .parallel.devarg import plan_flags

    _check_backend(backend)
    if target_gb is not None:
        label, t_gb, d_gb, heads = (
            f"{target_gb:g} GB target + {draft_gb:g} GB draft",
            target_gb,
            draft_gb,
            (),
        )
    else:
        found = get_pair(pair or OFFLINE_PAIR)
        t_gb, d_gb = found.memory_gb(backend)
        label, heads = found.name, _heads(found)
    inventory = detect()
    if as_json:
        payload = {"devices": dataclasses.asdict(inventory), "for": label}
        try:
            plan = plan_placement(inventory, t_gb, d_gb, heads=heads)
        except Exception:
            sys.stdout.write(json.dumps({**payload, "plan": None}) + "\n")
            raise
        sys.stdout.write(json.dumps({**payload, "plan": dataclasses.asdict(plan)}) + "\n")
        return
    table = Table(title="devices")
    for col in ("device", "name", "memory GB", "free GB", "usable GB"):
        table.add_column(col)
    for g in inventory.gpus:
        table.add_row(f"cuda:{g.index}", g.name, _gb(g.total_gb), _gb(g.free_gb), _gb(g.usable_gb))
    table.add_row(
        "cpu",
        f"{inventory.cpu_cores} cores",
        _gb(inventory.ram_gb),
        _gb(inventory.ram_available_gb),
        _gb(inventory.ram_usable_gb),
    )
    out.print(table)
    out.print(f"GPUs: {len(inventory.gpus)}; interconnect: {inventory.interconnect}")
    for note in inventory.notes:
        out.print(f"[dim]note: {note}[/dim]")
    out.print(
        f"\nplacement for {label} ({backend}, target {t_gb:g} GB, draft {d_gb:g} GB weights):"
    )
    plan = plan_placement(inventory, t_gb, d_gb, heads=heads)  # PlacementError -> exit 1
    plan_table = Table()
    for col in ("device", "role", "needs GB", "usable GB", "headroom GB"):
        plan_table.add_column(col)
    for use in plan.uses:
        plan_table.add_row(
            use.device, use.role, _gb(use.need_gb), _gb(use.usable_gb), _gb(use.headroom_gb)
        )
    out.print(plan_table)
    out.print(f"{_plan_summary(plan)}; tensor-parallel degree {plan.tensor_parallel}")
    out.print(f"flags: {plan_flags(plan)}", soft_wrap=True)  # what generate takes to reproduce it
    for note in plan.notes:
        out.print(f"[dim]note: {note}[/dim]")


# --------------------------------------------------------------------------- check


def check(
    pair: Annotated[
        str | None, typer.Option(help="Registry pair to check (must be pulled).")
    ] = None,
    target: Annotated[str | None, typer.Option(help="Target checkpoint dir or .gguf file.")] = None,
    draft: Annotated[
        str | None, typer.Option(help="Draft checkpoint dir, .gguf file, or 'ngram'.")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="float32 (must be identical) | bfloat16 | float16")
    ] = "float32",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 32,
    k: Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K).")] = 4,
    target_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    draft_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    target_devices: Annotated[
        str | None,
        typer.Option(
            help="Tensor-parallel target over these devices, e.g. cuda:0-3 "
            "(overrides --target-device)."
        ),
    ] = None,
    chat: Annotated[bool, typer.Option(help="Wrap prompts in the target's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run the pair greedily in AR, SD and SSD and verify the outputs are identical."""
    import dataclasses

    from .check import NEAR_TIE, run_check
    from .clirender import err_console
    from .config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
    from .errors import UsageError

    if pair is not None and (target is not None or draft is not None):
        raise UsageError(
            "--pair cannot be combined with --target/--draft",
            "pass either --pair NAME or both paths",
        )
    if (target is None) != (draft is None) and pair is None:
        raise UsageError("--target and --draft go together", "pass both, or --pair NAME")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    tp_devices: tuple[str, ...] = ()
    if target_devices is not None:
        from .parallel.devarg import parse_devices

        tp_devices = parse_devices(target_devices)
        target_device = tp_devices[0]
    SpecConfig(mode=Mode.SSD, k=k, draft=draft or "default")  # validate before any download
    ModelSpec(target or "default", target_device, dtype)
    ModelSpec(draft or "default", draft_device, dtype)
    if pair is not None:
        from .pairs import resolve_pair_paths

        target, draft = resolve_pair_paths(pair, dtype=dtype)
    elif target is None:
        from .cli import _default_pair

        target, draft = _default_pair(dtype)
    warnings: tuple[str, ...] = ()
    if draft != "ngram":
        from .compat import check_paths

        warnings = check_paths(target, draft).warnings  # before any weights are loaded
    config = EngineConfig(
        target=ModelSpec(target, target_device, dtype),
        spec=SpecConfig(mode=Mode.SSD, k=k, draft=draft),
        draft_model=ModelSpec(draft, draft_device, dtype) if draft != "ngram" else None,
        target_devices=tp_devices if len(tp_devices) > 1 else (),
    )
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
