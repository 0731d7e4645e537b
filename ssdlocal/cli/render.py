"""Terminal rendering for CLI commands: streaming text, stats line, JSON, progress bars.

Consumes engine events; the engine itself never prints.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from ssdlocal.core.config import EngineConfig, SamplingParams
from ssdlocal.core.events import DoneEvent, TokensEvent

err_console = Console(stderr=True)


# what each stage of a first-run fetch counts (weights/assets.py, backends/torch/gguf_convert.py)
STAGE_UNITS = {"download": "files", "assemble": "bytes", "dequantize": "tensors", "convert": "steps"}


class _AmountColumn(ProgressColumn):
    """`3/6 files`, `2/4 steps`, or `1.2/3.4 GB` for byte stages."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()

    def render(self, task) -> Text:
        unit = task.fields.get("unit", "steps")
        if unit == "bytes":
            return self._bytes.render(task)
        total = "?" if task.total is None else f"{task.total:.0f}"
        return Text(f"{task.completed:.0f}/{total} {unit}", style="progress.download")


class _SpeedColumn(ProgressColumn):
    """Transfer speed, for byte stages only."""

    def __init__(self) -> None:
        super().__init__()
        self._speed = TransferSpeedColumn()

    def render(self, task) -> Text:
        return self._speed.render(task) if task.fields.get("unit") == "bytes" else Text("")


@contextlib.contextmanager
def progress_callback(console: Console | None = None) -> Iterator:
    """A `progress(stage, done, total)` callback: one Rich display, a bar per stage (a
    new one when a finished stage starts again, e.g. for the draft), each in its unit."""
    bars = Progress(
        TextColumn("[bold]{task.description:<10}"),
        BarColumn(),
        _AmountColumn(),
        _SpeedColumn(),
        TimeRemainingColumn(),
        console=console or err_console,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int | None) -> None:
        task = tasks.get(stage)
        if task is not None:
            old = next(t for t in bars.tasks if t.id == task)
            if old.finished and done < (old.total or 0):
                task = None  # the same stage for the next file
        if task is None:
            task = tasks[stage] = bars.add_task(stage, total=total, unit=STAGE_UNITS.get(stage, "steps"))
        bars.update(task, completed=done, total=total)

    with bars:
        yield update


def format_stats(stats: dict) -> str:
    """One human line: tokens, speed, TTFT, acceptance, cache hits."""
    parts = [f"{stats['tokens']} tokens"]
    if stats.get("tokens_per_s"):
        parts.append(f"{stats['tokens_per_s']:.2f} tok/s")
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s'] * 1e3:.0f} ms")
    if stats.get("acceptance_rate") is not None:
        parts.append(f"acceptance {stats['acceptance_rate']:.0%}")
    if stats.get("mean_accepted_len") is not None:
        parts.append(f"{stats['mean_accepted_len']:.2f} tok/round")
    if stats.get("cache_hit_rate") is not None:
        parts.append(f"cache hits {stats['cache_hit_rate']:.0%}")
    if stats.get("constrained"):
        parts.append(f"grammar {stats['mask_ms_per_token']:.2f} ms/token")
    return " | ".join(parts)


def graph_warning(stats: dict) -> str | None:
    """One line when captured steps were refused or dropped for any model, else None."""
    parts = []
    for model, report in (stats.get("graphs") or {}).items():
        refused, dropped = report.get("refused", 0), report.get("dropped", 0)
        if refused or dropped:
            what = [f"{refused} shape(s) refused"] if refused else []
            what += [f"dropped {dropped} time(s)"] if dropped else []
            why = (report.get("notes") or [""])[0]
            parts.append(f"{model} {', '.join(what)}" + (f" ({why})" if why else ""))
    if not parts:
        return None
    return "graphs: " + "; ".join(parts) + " - those steps ran eagerly (same output, slower)"


def run_generate(
    config: EngineConfig, prompts: list[str], params: SamplingParams, *, chat: bool, as_json: bool,
    grammar: tuple[str, object] | None = None,
) -> None:
    """Load the engine, generate, and print (streamed text, or one JSON object); `grammar`
    (kind, source) constrains every answer (grammar.compiler)."""
    from ssdlocal.engine import Engine

    with err_console.status(f"loading {config.target.path} ...", spinner="dots"):
        engine = Engine(config)
    with engine:
        grammars = None
        if grammar is not None:
            from ssdlocal.grammar.compiler import GrammarCompiler

            compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
            grammars = [compiler.compile(*grammar)] * len(prompts)
        stream = not as_json and len(prompts) == 1
        done: DoneEvent | None = None
        for event in engine.generate(prompts, params, chat=chat, grammars=grammars):
            if isinstance(event, TokensEvent) and stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, DoneEvent):
                done = event
    if done is None:  # pragma: no cover - generate always ends with a DoneEvent
        raise RuntimeError("the engine ended without a DoneEvent")
    warning = graph_warning(done.stats)
    if warning:
        err_console.print(f"[yellow]{escape(warning)}[/yellow]", soft_wrap=True)
    if as_json:
        payload = {
            "mode": done.stats["mode"],
            "outputs": [
                {"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason}
                for o in done.outputs
            ],
            "stats": done.stats,
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    if stream:
        sys.stdout.write("\n")
    else:
        for i, out in enumerate(done.outputs):
            sys.stdout.write(f"=== [{i}] ===\n{out.text}\n")
    # soft_wrap: one line however narrow the terminal (or 80 columns when not a terminal)
    stats = done.stats
    reason = escape(stats["mode_reason"])
    err_console.print(f"[dim]mode {stats['mode']}: {reason}[/dim]", soft_wrap=True)
    err_console.print(f"[dim]{stats['mode']}: {format_stats(stats)}[/dim]", soft_wrap=True)
