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

from ssdlocal.core.config import EngineConfig, SamplingParams
from ssdlocal.core.events import DoneEvent, ModeEvent, TokensEvent
from ssdlocal.core.metrics import Metrics
from ssdlocal.grammar.kinds import GrammarSpec

from ssdlocal.cli.progress import err_console  # noqa: E402 - one stderr console for the CLI


@contextlib.contextmanager
def progress_callback(console: Console | None = None) -> Iterator:
    """A `progress(stage, done, total)` callback: a bar per stage on stderr (plain lines
    when stderr is not a terminal), each in its unit; see cli/progress.py."""
    from ssdlocal.cli.progress import preparing

    with preparing(console) as progress:
        yield progress


def format_stats(stats: Metrics) -> str:
    """One human line: tokens, speed, TTFT, acceptance, cache hits, grammar time."""
    parts = [f"{stats.tokens} tokens"]
    if stats.tokens_per_s:
        parts.append(f"{stats.tokens_per_s:.2f} tok/s")
    if stats.ttft_s is not None:
        parts.append(f"TTFT {stats.ttft_s * 1e3:.0f} ms")
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.0%}")
    if stats.mean_accepted_len is not None:
        parts.append(f"{stats.mean_accepted_len:.2f} tok/round")
    if stats.cache_hit_rate is not None:
        parts.append(f"cache hits {stats.cache_hit_rate:.0%}")
    if stats.grammar is not None:
        parts.append(f"grammar {stats.grammar.mask_ms_per_token:.2f} ms/token")
    return " | ".join(parts)


def graph_warning(stats: Metrics) -> str | None:
    """One line when captured steps were refused or dropped for any model, else None."""
    parts = []
    for model, report in (stats.graphs or {}).items():
        refused, dropped = report.get("refused", 0), report.get("dropped", 0)
        if refused or dropped:
            what = [f"{refused} shape(s) refused"] if refused else []
            what += [f"dropped {dropped} time(s)"] if dropped else []
            why = (report.get("notes") or [""])[0]
            parts.append(f"{model} {', '.join(what)}" + (f" ({why})" if why else ""))
    if not parts:
        return None
    return "graphs: " + "; ".join(parts) + " - those steps ran eagerly (same output, slower)"


def _same_every_run(config: EngineConfig, prompts: int, stats) -> bool:
    """Whether these answers' greedy tokens are the same on every run of the command, with
    or without other prompts beside them (not for prompts batched on llama.cpp's CPU kernels)."""
    from ssdlocal.backends.llamacpp.alike import same_every_run

    target, drafted = config.target, stats.acceptance_rate is not None  # a rate: something was drafted
    return same_every_run(target.backend, target.device, target.batch_invariant, drafted=drafted, alone=prompts == 1)


def run_generate(
    config: EngineConfig,
    prompts: list[str],
    params: SamplingParams,
    *,
    chat: bool,
    as_json: bool,
    grammar: GrammarSpec | None = None,
    fim_suffix: str | None = None,
) -> None:
    """Load the engine, say which mode runs and why (stderr, before the first token),
    generate, and print (streamed text, or one JSON object); `grammar`
    (grammar.kinds.GrammarSpec) constrains every answer (grammar.compiler); `fim_suffix`: each prompt is the text
    before the insertion point and this the text after it (engine/fim.py)."""
    engine = load_engine(config)
    with engine:
        if fim_suffix is not None:
            from ssdlocal.engine.fim import fim_prompt, fim_tokens, no_fim_error

            tokens = fim_tokens(engine.tokenizer)
            if tokens is None:
                raise no_fim_error("--fim-suffix")
            prompts = [fim_prompt(engine.tokenizer, tokens, p, fim_suffix) for p in prompts]
        grammars = None
        if grammar is not None:
            from ssdlocal.grammar.compiler import GrammarCompiler

            compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
            grammars = [compiler.compile(grammar)] * len(prompts)
        print_mode(engine.choice)
        stream = not as_json and len(prompts) == 1
        done: DoneEvent | None = None
        changes: list[ModeEvent] = []
        for event in engine.generate(prompts, params, chat=chat, grammars=grammars):
            if isinstance(event, TokensEvent) and stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, ModeEvent):
                changes.append(event)
            elif isinstance(event, DoneEvent):
                done = event
    if done is None:  # pragma: no cover - generate always ends with a DoneEvent
        raise RuntimeError("the engine ended without a DoneEvent")
    warning = graph_warning(done.stats)
    if warning:
        err_console.print(f"[yellow]{escape(warning)}[/yellow]", soft_wrap=True)
    if as_json:
        payload = {
            "mode": done.stats.mode,
            "outputs": [
                {"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason} for o in done.outputs
            ],
            "stats": done.stats.to_dict(),
            "same_every_run": _same_every_run(config, len(prompts), done.stats),
        }
        if changes:  # the engine changed its mind mid-answer (engine/auto.ModeCheck)
            payload["mode_changes"] = [
                {"after_round": c.round_index, "mode": c.mode, "reason": c.reason} for c in changes
            ]
        _print_changes(changes)
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    if stream:
        sys.stdout.write("\n")
    else:
        for i, out in enumerate(done.outputs):
            sys.stdout.write(f"=== [{i}] ===\n{out.text}\n")
    _print_changes(changes)
    # soft_wrap: one line however narrow the terminal (or 80 columns when not a terminal)
    stats = done.stats
    err_console.print(f"[dim]{stats.mode}: {escape(format_stats(stats))}[/dim]", soft_wrap=True)


def load_engine(config: EngineConfig):
    """The Engine for `config`, with its loading and calibration shown as progress."""
    from ssdlocal.cli.progress import preparing
    from ssdlocal.engine import Engine

    with preparing() as progress:
        progress("starting the engine", 0, 1)  # a line at once, before the first step reports
        engine = Engine(config)
        progress("starting the engine", 1, 1)
    return engine


def weights_line(config: EngineConfig) -> str:
    """`weights: target int4 from x.gguf (Q4_K_M) · draft int4 from y.gguf (Q4_K_M)`."""
    from ssdlocal.weights.describe import spec_label

    parts = [f"target {spec_label(config.target)}"]
    if config.draft_model is not None:
        parts.append(f"draft {spec_label(config.draft_model)}")
    return "weights: " + " · ".join(parts)


def print_mode(choice) -> None:
    """The engine's mode and its short reason: one line on stderr (`mode sd: ...`)."""
    err_console.print(f"[dim]{escape(choice.line)}[/dim]", soft_wrap=True, highlight=False)


def _print_changes(changes) -> None:
    for change in changes:
        err_console.print(
            f"[yellow]mode {change.mode} after round {change.round_index + 1}: {escape(change.short)}[/yellow]",
            soft_wrap=True,
            highlight=False,
        )
