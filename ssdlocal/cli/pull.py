"""Typer commands `pull` and `rm`: download a pair or any model by its repository id, and
free a model's files.

Wiring and rendering only: registry pairs download through ssdlocal.weights.hub, models
named by repository through ssdlocal.weights.pulled (plan, drafts, pair file), removal is
ssdlocal.weights.remove; whether a model fits is the placement planner's (cli/models.py).
Domain errors propagate to main().
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ssdlocal.core.errors import UsageError
from ssdlocal.core.memory import human_bytes
from ssdlocal.core.models import DEFAULT_DTYPE, BackendName
from ssdlocal.core.quantization import DType, Quantization

out = Console(soft_wrap=True, highlight=False)
FILES_SHOWN = 6  # files listed per model in a pull's plan (then "and N more")


def pull(
    pair: Annotated[
        str,
        typer.Argument(
            help="Pair name (see `ssdlocal pairs`), a pair .toml file, or a Hugging Face repository: "
            "ORG/NAME (safetensors) or ORG/NAME-GGUF:QUANT (one GGUF file, e.g. Q4_K_M)."
        ),
    ],
    backend: Annotated[str, typer.Option(help="torch (safetensors) | llamacpp (GGUF); pairs only")] = "torch",
    dtype: Annotated[
        str, typer.Option(help="dtype of the converted checkpoint (offline pair, torch).")
    ] = DEFAULT_DTYPE,
    update: Annotated[
        bool,
        typer.Option(
            help="Trust the commit the pair's revision resolves to now, replacing the locked one from the first pull."
        ),
    ] = False,
    quantization: Annotated[
        str,
        typer.Option(
            help="Weights to prepare for the torch backend, as `generate` will load them: none "
            "(a bf16 checkpoint from a GGUF pair) | int8 | int4 | auto (a GGUF's own class)."
        ),
    ] = "auto",
    revision: Annotated[
        str, typer.Option(help="Repository ids: the branch, tag or commit to pull (the pair file pins its commit).")
    ] = "main",
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            "-y",
            help="Repository ids: download without asking. Without a terminal to ask, a pull of a "
            "repository shows its plan and downloads nothing unless this is given.",
        ),
    ] = False,
) -> None:
    """Download a pair's target and draft, or any model by its repository id with a draft
    found for it, and lock the commits (trusted on first use).

    A repository id shows what it will download and whether it fits here, and asks first.
    After an interruption, run it again: finished files are kept, a file cut off midway
    starts over.
    """
    from ssdlocal.weights.repo import parse_spec

    backend = BackendName.parse(backend, "backend")
    quantization = Quantization.parse(quantization, "--quantization")
    dtype = DType.parse(dtype, "--dtype")
    spec = None if pair.endswith(".toml") or Path(pair).expanduser().exists() else parse_spec(pair)
    if spec is None:
        _pull_pair(pair, backend, dtype, update, quantization)
    else:
        _pull_repo(spec, revision, yes=yes, update=update)


def _pull_pair(name: str, backend: BackendName, dtype: DType, update: bool, quantization: Quantization) -> None:
    from ssdlocal.cli.render import err_console, progress_callback
    from ssdlocal.weights.hub import pull as hub_pull
    from ssdlocal.weights.pairs import get_pair

    found = get_pair(name)
    err_console.print(f"pulling {found.name} ({backend}): {found.target.label} + {found.draft_label}")
    with progress_callback() as progress:
        result = hub_pull(found, backend, dtype=dtype, progress=progress, update=update, quantization=quantization)
        if backend.quantizes and quantization is not Quantization.NONE:
            result = _prepare_quantized(result, quantization, dtype, progress)
    for role, path, commit in (
        ("target", result.target, result.commits[0]),
        ("draft", result.draft, result.commits[1]),
    ):
        at = f" (commit {commit})" if commit else ""
        out.print(f"{role}: {path or found.draft_label}{at}")
    out.print(f'[dim]use it: ssdlocal generate --pair {found.name} "your prompt"[/dim]')


def _prepare_quantized(result, quantization: Quantization, dtype: DType, progress):
    """Build the quantized caches of a pulled pair's GGUF files now, not at the first run."""
    import dataclasses

    from ssdlocal.backends.registry import prepare_weights

    paths = [
        prepare_weights(path, BackendName.TORCH, quantization, dtype, progress, floats=False) if path else None
        for path in (result.target, result.draft)
    ]
    return dataclasses.replace(result, target=paths[0], draft=paths[1])


# --------------------------------------------------------------------------- by repository


def _pull_repo(spec, revision: str, *, yes: bool, update: bool) -> None:
    from ssdlocal.cli.render import err_console
    from ssdlocal.weights.pulled import make_plan, pull_model

    with err_console.status(f"listing {spec.repo} and its draft candidates on the hub ...", spinner="dots"):
        plan = make_plan(spec, revision)
    fits = _show_plan(plan)
    _confirm(plan, fits, yes)
    pulled = pull_model(plan, lambda line: err_console.print(escape(line), soft_wrap=True), update=update)
    out.print(f"target: {pulled.target} (commit {plan.target.commit})")
    if pulled.draft is not None and plan.draft is not None:
        out.print(f"draft: {pulled.draft} (commit {plan.draft.commit})")
        out.print(f"draft {plan.draft.repo}: {plan.draft_why}; it passed the pair check (tokenizer and vocabulary)")
        for warning in pulled.warnings:
            out.print(f"[dim]note: {escape(warning)}[/dim]")
    else:
        out.print(_no_draft_line(plan))
    out.print(f"pair {pulled.pair.name} written to {pulled.file}")
    out.print(
        f'[dim]use it: ssdlocal generate --pair {pulled.pair.name} "your prompt"; free it: ssdlocal rm {pulled.pair.name}[/dim]'
    )


def _no_draft_line(plan) -> str:
    tried = f" ({'; '.join(plan.skipped)})" if plan.skipped else ""
    family = f" of the {plan.family} family" if plan.family else ""
    return f"draft: no smaller model{family} passed the pair check{tried}; the pair drafts with suffix proposals"


def _show_plan(plan) -> bool:
    """Print what the pull will download and whether it fits here; whether it fits."""
    from ssdlocal.cli.models import plan_or_reason
    from ssdlocal.placement.inventory import detect
    from ssdlocal.weights.pulled import to_pair

    kind = f"GGUF {plan.target.quant}" if plan.target.gguf else "safetensors"
    out.print(f"pull {plan.spec} at commit {plan.target.commit[:12]} ({kind}) as pair {plan.name}:")
    _show_files("target", plan.target, "")
    if plan.draft is not None:
        when = (
            "once downloaded (its tokenizer is inside the file)" if plan.draft.gguf else "before its weights download"
        )
        _show_files("draft", plan.draft, f"{plan.draft_why}; the pair check verifies it {when}")
    else:
        out.print(f"  {_no_draft_line(plan)}")
    out.print(f"  total: {human_bytes(plan.total)} to download ({plan.total:,} bytes)")
    pair = to_pair(plan)
    backend = BackendName.LLAMACPP if plan.target.gguf else BackendName.TORCH
    found, reason = plan_or_reason(detect(), pair, backend, Quantization.AUTO)
    t_gb, d_gb = pair.memory_gb(backend, Quantization.AUTO)
    sizes = f"weights {t_gb:.2f} GB + {d_gb:.2f} GB"
    if found is not None:
        out.print(f"  fits here ({sizes}): {reason}")
    else:
        out.print(f"  [red]does not fit here[/red] ({sizes}): {escape(reason)}")
    if plan.target.gated:
        out.print(
            f"  [yellow]{plan.spec.repo} is gated: accept its licence on huggingface.co and set HF_TOKEN[/yellow]"
        )
    return found is not None


def _show_files(role: str, sel, why: str) -> None:
    extra = f" — {why}" if why else ""
    files = f"{len(sel.files)} file{'s' * (len(sel.files) != 1)}"
    out.print(f"  {role} {sel.repo}: {files}, {human_bytes(sel.total)}{escape(extra)}")
    names = sorted(sel.files, key=lambda n: -sel.files[n])
    for name in names[:FILES_SHOWN]:
        out.print(f"    [dim]{escape(name)}  {human_bytes(sel.files[name])}[/dim]")
    if len(names) > FILES_SHOWN:
        out.print(
            f"    [dim]and {len(names) - FILES_SHOWN} more ({human_bytes(sum(sel.files[n] for n in names[FILES_SHOWN:]))})[/dim]"
        )


def _confirm(plan, fits: bool, yes: bool) -> None:
    """Ask before downloading: --yes skips it; without a terminal nothing is downloaded."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"not downloading {plan.spec}: a pull by repository asks first, and there is no terminal to ask",
            f"pass --yes to download the {human_bytes(plan.total)} above: ssdlocal pull {plan.spec} --yes",
        )
    if not typer.confirm(f"download {human_bytes(plan.total)}?", default=fits):
        raise typer.Exit(1)


# --------------------------------------------------------------------------- rm


def rm(
    name: Annotated[
        str,
        typer.Argument(
            help="A pair (`ssdlocal pairs`), a repository id pulled by name (ORG/NAME, ORG/NAME-GGUF:QUANT), "
            "or a path inside the caches."
        ),
    ],
) -> None:
    """Free a model's downloaded files (and what ssdlocal built from them).

    A repository another pulled pair uses is kept. The pair file `pull` wrote for a model
    pulled by name goes too; built-in pairs and your own pair files stay. Paths outside
    ssdlocal's cache and the Hugging Face cache are refused.
    """
    from ssdlocal.weights.remove import free, plan_removal

    freeing = plan_removal(name)
    for kept in freeing.kept:
        out.print(f"kept {kept}")
    if not freeing.entries and freeing.pair_file is None:
        out.print(f"nothing of {freeing.name} is downloaded: nothing freed")
        return
    size = free(freeing)
    for entry in freeing.entries:
        out.print(f"removed {entry.name} ({human_bytes(entry.size)}, {entry.path})")
    if freeing.pair_file is not None:
        out.print(f"removed the pair file {freeing.pair_file}")
    out.print(f"freed {human_bytes(size)} of {freeing.name}")
