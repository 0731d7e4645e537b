"""`ssdlocal generate`: options -> EngineConfig + SamplingParams -> stream or JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from ssdlocal.cli import options as o
from ssdlocal.cli.options import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    model_command,
)
from ssdlocal.cli.resolve import engine_config
from ssdlocal.core.errors import UsageError
from ssdlocal.grammar.kinds import GrammarKind, GrammarSpec


@model_command("generate")
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts (a batch).")],
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    chat: o.Chat = False,
    num_samples: Annotated[int, typer.Option(help="Independent samples of a single prompt.")] = 1,
    as_json: o.Json = False,
    json_schema: Annotated[
        Path | None,
        typer.Option(help="Answer with JSON that validates against this JSON schema file (constrained decoding)."),
    ] = None,
    regex: Annotated[str | None, typer.Option(help="Answer with text that matches this regular expression.")] = None,
    fim_suffix: Annotated[
        str | None,
        typer.Option(
            help="Fill in the middle: each prompt is the text before the insertion point and this the text "
            "after it (the model's own FIM tokens; a code model trained for it)."
        ),
    ] = None,
) -> None:
    """Generate text, streaming tokens as they are accepted."""
    if num_samples < 1:
        raise UsageError(f"num-samples must be >= 1, got {num_samples}", "use --num-samples 1")
    if num_samples > 1 and len(prompts) != 1:
        raise UsageError("--num-samples needs exactly one prompt", "pass a single prompt")
    if fim_suffix is not None and chat:
        raise UsageError(
            "--fim-suffix cannot be combined with --chat",
            "drop --chat: a fill-in-the-middle prompt is raw text before and after the cursor",
        )
    if fim_suffix is None and any(not p.strip() for p in prompts):
        raise UsageError("empty prompt", "pass some text to generate from")
    grammar = _grammar(json_schema, regex)
    params = sampling.params()
    if models.prefix_cache_tokens is None:  # one call, then the process ends: no later call could
        models = replace(models, prefix_cache=False)  # reuse a prefix, and the store costs memory and time
    config = engine_config(models, spec)
    from ssdlocal.cli.render import run_generate

    run_generate(
        config, list(prompts) * num_samples, params, chat=chat, as_json=as_json, grammar=grammar, fim_suffix=fim_suffix
    )


def _grammar(schema_file: Path | None, regex: str | None) -> GrammarSpec | None:
    """The grammar of --json-schema / --regex, checked before any model loads."""
    if schema_file is not None and regex is not None:
        raise UsageError("--json-schema and --regex cannot be combined", "pass one of them")
    if schema_file is None and regex is None:
        return None
    from ssdlocal.grammar.compiler import check

    if regex is not None:
        grammar = GrammarSpec(GrammarKind.REGEX, regex)
        check(grammar)
        return grammar
    try:
        schema = json.loads(Path(schema_file).expanduser().read_text())
    except OSError as exc:
        raise UsageError(
            f"cannot read the schema file {schema_file}: {exc.strerror or exc}", "pass the path of a JSON schema file"
        ) from None
    except ValueError as exc:
        raise UsageError(f"{schema_file} is not JSON: {exc}", "write the schema as a JSON object") from None
    grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, schema)
    check(grammar)
    return grammar
