"""Typer commands `chat` and `race`: wiring only.

Both take the shared model options of options.py (its COMMANDS table says which). Textual
is imported only when a TUI actually starts (with an install hint when missing); `race
--no-tui` prints a Rich table instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from ssdlocal.cli.options import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    model_command,
)
from ssdlocal.cli.resolve import engine_config, parse_mode
from ssdlocal.core.config import EngineConfig, Mode, SamplingParams
from ssdlocal.core.errors import UsageError


def _engine_factory(config: EngineConfig):
    def load():
        from ssdlocal.engine import (
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
        engine = app.release_engine()  # one still loading closes itself when it is ready
        if engine is not None:
            engine.close()
    if app.load_failed:  # the error and its hint were shown in the app
        raise typer.Exit(1)


@model_command("chat")
def chat(
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
) -> None:
    """Interactive chat (Textual) with live speculation stats; F1 for help."""
    from ssdlocal.tui import require_textual
    from ssdlocal.tui.core import ChatSettings

    parse_mode(spec.mode)
    require_textual()
    params = sampling.params()
    config = engine_config(models, spec, keep_draft=True)
    settings = ChatSettings(config.spec, params)
    from ssdlocal.tui.app import ChatApp

    _run_app(ChatApp(_engine_factory(config), config, settings, system=system))


@model_command("race")
def race(
    prompt: Annotated[str, typer.Argument(help="The prompt all three modes answer.")],
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    chat_template: Annotated[
        bool, typer.Option("--chat/--raw", help="Wrap the prompt in the model's chat template.")
    ] = True,
    warmup: Annotated[bool, typer.Option(help="One short untimed run per mode first.")] = True,
    speed: Annotated[float, typer.Option(help="Replay speed (1 = real time).")] = 1.0,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="Print a table instead of the TUI.")] = False,
) -> None:
    """AR | SD | SSD side by side on one prompt: speedups and an identical-output check.

    The modes run one after another and are replayed with their measured timings; a mode
    run while other load used the CPU is run again once, and said if still disturbed. On
    kernels whose logits part with the call width (llama.cpp on a CPU) every mode's steps
    are batch-invariant, so greedy outputs are identical.
    """
    from ssdlocal.tui.race import race_specs
    from ssdlocal.tui.facts import exact_config

    if not prompt.strip():
        raise UsageError("empty prompt", "pass some text to generate from")
    if not speed > 0:
        raise UsageError(f"speed must be > 0, got {speed}", "use --speed 1 for real time")
    params = sampling.params()
    if not no_tui:
        from ssdlocal.tui import require_textual

        require_textual()
    config = engine_config(
        models,
        replace(spec, mode="ssd"),  # the worker loads the draft at start
        need_draft="the race needs a draft for SD and SSD",
    )
    if not config.spec.draft.ssd:  # a draft head: the race runs AR and SD, and says why not SSD
        config = replace(config, spec=replace(config.spec, mode=Mode.SD))
    default, config = config, exact_config(config)
    specs = race_specs(config.spec)
    if no_tui:
        _race_plain(config, default, prompt, specs, params, chat=chat_template, warmup=warmup)
        return
    from ssdlocal.tui.app import RaceApp

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
            default_config=default,
        )
    )


def _race_plain(
    config: EngineConfig, default: EngineConfig, prompt: str, specs, params: SamplingParams, *, chat: bool, warmup: bool
) -> None:
    """`race --no-tui`: run the three modes and print the answer, a Rich table and the
    lines beside it (tui/facts.footer_lines; the SSD draft's hardware)."""
    from rich.console import Console

    from ssdlocal.cli.progress import preparing
    from ssdlocal.cli.render import load_engine
    from ssdlocal.tui.race import record_mode, summarize, summary_legend, summary_table
    from ssdlocal.tui.facts import footer_lines, ssd_note

    with preparing() as progress:  # every step on stderr: loading, warm-up, each mode's run
        engine = load_engine(config)
        with engine:
            ids = engine.encode(prompt, chat)
            if warmup:
                short = SamplingParams(
                    temperature=params.temperature,
                    seed=params.seed,
                    max_new_tokens=min(4, params.max_new_tokens),
                )
                stage = "warming up " + ", ".join(s.mode.value.upper() for s in specs)
                for n, spec in enumerate(specs):  # SD's first call loads the draft here (once)
                    progress(stage, n, len(specs))
                    for _ in engine.generate([ids], short, spec=spec):
                        pass
                progress(stage, len(specs), len(specs))
            runs = []
            for spec in specs:
                stage = f"running {spec.mode.value.upper()}"
                progress(stage, 0, params.max_new_tokens)
                runs.append(
                    record_mode(
                        engine,
                        ids,
                        params,
                        spec,
                        on_tokens=lambda n, _new, stage=stage: progress(stage, n, params.max_new_tokens),
                        on_rerun=lambda load, mode=spec.mode.value.upper(): progress(
                            f"running {mode} again ({load.describe()})", 0, params.max_new_tokens
                        ),
                    )
                )
                progress(stage, params.max_new_tokens, params.max_new_tokens)
    console = Console()
    first = runs[0].output
    console.print(first.text if first else "", markup=False, highlight=False)
    rows = summarize(runs)
    title = " | ".join(s.mode.value.upper() for s in specs)
    console.print(summary_table(rows, title=f"{title}, run one after another"))
    console.print(summary_legend(), style="dim", highlight=False)
    for line in footer_lines(rows, config, default, params.greedy):
        console.print(line, markup=False, highlight=False)
    costs = getattr(engine, "costs", None)  # the draft model's measured cost per token
    if config.spec.draft.ssd:  # else footer_lines said why SSD did not run
        console.print(f"SSD: {ssd_note(config, runs, costs=costs)}", markup=False, highlight=False)
