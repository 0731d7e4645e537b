"""`ssdlocal generate`: options -> EngineConfig + SamplingParams -> stream or JSON."""

from __future__ import annotations

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


@model_command("generate")
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts (a batch).")],
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
    chat: o.Chat = False,
    num_samples: Annotated[int, typer.Option(help="Independent samples of a single prompt.")] = 1,
    as_json: o.Json = False,
) -> None:
    """Generate text, streaming tokens as they are accepted."""
    if num_samples < 1:
        raise UsageError(f"num-samples must be >= 1, got {num_samples}", "use --num-samples 1")
    if num_samples > 1 and len(prompts) != 1:
        raise UsageError("--num-samples needs exactly one prompt", "pass a single prompt")
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt", "pass some text to generate from")
    params = sampling.params()
    config = engine_config(models, spec)
    from ssdlocal.cli.render import run_generate

    run_generate(config, list(prompts) * num_samples, params, chat=chat, as_json=as_json)
