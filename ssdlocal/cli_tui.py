"""Typer commands `chat` and `race` (registered on the app in cli.py): wiring only.

Options mirror `generate`. Textual is imported only when a TUI actually starts (with an
install hint when missing); `race --no-tui` prints a Rich table instead.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from .errors import UsageError

TargetOpt = Annotated[
    str | None,
    typer.Option(
        help="Target checkpoint dir or .gguf file. Default: the offline Qwen2.5-Coder 1.5B."
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(help="Draft checkpoint dir, .gguf file, or 'ngram'. Default: Qwen2.5-Coder 0.5B."),
]
KOpt = Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K).")]
TempOpt = Annotated[float, typer.Option(help="0 = greedy.")]
TopKOpt = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")]
SeedOpt = Annotated[int, typer.Option(help="Random seed (sampling is reproducible).")]
DtypeOpt = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
DeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
FanOpt = Annotated[
    str | None,
    typer.Option(help="SSD fan-out per accepted length after a hit, e.g. 3,3,2,2,1, or auto."),
]
FanMissOpt = Annotated[str | None, typer.Option(help="SSD fan-out after a miss, or auto.")]
SaguaroOpt = Annotated[float, typer.Option(help="Saguaro sampling constant C in (0, 1].")]
BackupOpt = Annotated[str, typer.Option(help="SSD backup on a miss: auto | jit | ngram | none")]


def _engine_config(
    target,
    draft,
    mode: Mode,
    k,
    dtype,
    target_device,
    draft_device,
    fan_out,
    fan_out_miss,
    saguaro_c,
    backup,
    *,
    need_draft: bool,
) -> EngineConfig:
    """Validate every option, fetch the default pair if needed, build the EngineConfig.

    The draft stays loaded whatever the starting mode, so the chat can switch modes.
    """
    from .cli import _default_pair
    from .config import parse_fan_out

    if need_draft and target is not None and draft is None:
        raise UsageError(
            "the race needs a draft for SD and SSD",
            "pass --draft PATH (same tokenizer as the target) or --draft ngram",
        )
    if target is not None and mode is not Mode.AR and draft is None:
        raise UsageError(
            f"--mode {mode.value} needs --draft",
            "pass --draft PATH or --draft ngram, or use --mode ar",
        )
    options = {
        "k": k,
        "fan_out": parse_fan_out(fan_out),
        "fan_out_miss": parse_fan_out(fan_out_miss),
        "saguaro_c": saguaro_c,
        "backup": backup,
    }
    # validate before the default pair is fetched (which can take minutes)
    SpecConfig(mode=mode, draft=draft or "default", **options)
    ModelSpec(target or "default", target_device, dtype)
    ModelSpec(draft or "default", draft_device, dtype)
    if target is None:
        target, default_draft = _default_pair(dtype)
        draft = draft or default_draft
    spec = SpecConfig(mode=mode, draft=draft, **options)
    draft_model = ModelSpec(draft, draft_device, dtype) if draft and draft != "ngram" else None
    return EngineConfig(
        target=ModelSpec(target, target_device, dtype), spec=spec, draft_model=draft_model
    )


def _mode(mode: str) -> Mode:
    try:
        return Mode(mode.lower())
    except ValueError:
        raise UsageError(f"unknown mode {mode!r}", "choose one of: ar, sd, ssd") from None


def _engine_factory(config: EngineConfig):
    def load():
        from .engine import (
            Engine,  # torch is imported in the loading thread, not before the UI
        )

        return Engine(config)

    return load


def prepare_subprocesses() -> None:
    """Start multiprocessing's resource tracker while sys.stderr is still the terminal.

    Textual replaces sys.stderr with a capture object whose fileno() is -1; spawning the
    SSD draft worker from inside the app would then fail ("bad value(s) in fds_to_keep").
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _run_app(app) -> None:
    prepare_subprocesses()
    try:
        app.run()
    finally:
        engine = app.loaded_engine
        if engine is not None:
            engine.close()
    if app.load_failed:  # the error and its hint were shown in the app
        raise typer.Exit(1)


def chat(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    mode: Annotated[str, typer.Option(help="Starting mode: ar | sd | ssd (F2 switches).")] = "ssd",
    k: KOpt = 4,
    temperature: TempOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per answer at most.")] = 256,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    dtype: DtypeOpt = "bfloat16",
    target_device: DeviceOpt = "cpu",
    draft_device: DeviceOpt = "cpu",
    fan_out: FanOpt = None,
    fan_out_miss: FanMissOpt = None,
    saguaro_c: SaguaroOpt = 1.0,
    backup: BackupOpt = "auto",
) -> None:
    """Interactive chat (Textual) with live speculation stats; F1 for help."""
    from .tui import require_textual
    from .tui.core import ChatSettings

    mode_enum = _mode(mode)
    require_textual()
    settings = ChatSettings(
        mode=mode_enum,
        k=k,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        max_new_tokens=max_new_tokens,
        draft=draft or "default",
    )
    config = _engine_config(
        target,
        draft,
        mode_enum,
        k,
        dtype,
        target_device,
        draft_device,
        fan_out,
        fan_out_miss,
        saguaro_c,
        backup,
        need_draft=False,
    )
    from dataclasses import replace

    settings = replace(settings, draft=config.spec.draft, fan_out=config.spec.fan_out)
    from .tui.app import ChatApp

    _run_app(ChatApp(_engine_factory(config), config, settings, system=system))


def race(
    prompt: Annotated[str, typer.Argument(help="The prompt all three modes answer.")],
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: KOpt = 4,
    temperature: TempOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per run.")] = 128,
    dtype: DtypeOpt = "bfloat16",
    target_device: DeviceOpt = "cpu",
    draft_device: DeviceOpt = "cpu",
    fan_out: FanOpt = None,
    fan_out_miss: FanMissOpt = None,
    saguaro_c: SaguaroOpt = 1.0,
    backup: BackupOpt = "auto",
    chat_template: Annotated[
        bool, typer.Option("--chat/--raw", help="Wrap the prompt in the model's chat template.")
    ] = True,
    warmup: Annotated[bool, typer.Option(help="One short untimed run per mode first.")] = True,
    speed: Annotated[float, typer.Option(help="Replay speed (1 = real time).")] = 1.0,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="Print a table instead of the TUI.")
    ] = False,
) -> None:
    """AR | SD | SSD side by side on one prompt: speedups and an identical-output check.

    The modes run one after another and are replayed with their measured timings.
    """
    from .tui.race import race_specs

    if not prompt.strip():
        raise UsageError("empty prompt", "pass some text to generate from")
    if not speed > 0:
        raise UsageError(f"speed must be > 0, got {speed}", "use --speed 1 for real time")
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens
    )
    if not no_tui:
        from .tui import require_textual

        require_textual()
    config = _engine_config(
        target,
        draft,
        Mode.SSD,
        k,
        dtype,
        target_device,
        draft_device,
        fan_out,
        fan_out_miss,
        saguaro_c,
        backup,
        need_draft=True,
    )
    specs = race_specs(config.spec)
    if no_tui:
        _race_plain(config, prompt, specs, params, chat=chat_template, warmup=warmup)
        return
    from .tui.app import RaceApp

    _run_app(
        RaceApp(
            _engine_factory(config),
            config,
            prompt,
            specs,
            params,
            chat=chat_template,
            warmup=warmup,
            speed=speed,
        )
    )


def _race_plain(
    config: EngineConfig, prompt: str, specs, params: SamplingParams, *, chat: bool, warmup: bool
) -> None:
    """`race --no-tui`: run the three modes and print the answer and a Rich table."""
    from rich.console import Console

    from .clirender import err_console
    from .engine import Engine
    from .tui.race import identical_verdict, record_run, summarize, summary_table

    with err_console.status(f"loading {config.target.path} ...", spinner="dots"):
        engine = Engine(config)
    with engine:
        ids = engine.encode(prompt, chat)
        if warmup:
            short = SamplingParams(
                temperature=params.temperature,
                seed=params.seed,
                max_new_tokens=min(4, params.max_new_tokens),
            )
            with err_console.status("warming up ...", spinner="dots"):
                for spec in specs:
                    for _ in engine.generate([ids], short, spec=spec):
                        pass
        runs = []
        for spec in specs:
            with err_console.status(f"running {spec.mode.value.upper()} ...", spinner="dots"):
                runs.append(record_run(engine, ids, params, spec))
    console = Console()
    first = runs[0].output
    console.print(first.text if first else "", markup=False, highlight=False)
    rows = summarize(runs)
    console.print(summary_table(rows, title="AR | SD | SSD, run one after another"))
    verdict = identical_verdict(rows, params.greedy)
    if verdict:
        console.print(verdict, markup=False, highlight=False)
