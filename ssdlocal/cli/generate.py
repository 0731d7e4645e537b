"""`ssdlocal generate`: options -> EngineConfig + SamplingParams -> stream or JSON."""

from __future__ import annotations

from typing import Annotated

import typer

from ssdlocal.cli import options as o
from ssdlocal.cli.resolve import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    engine_config,
    gather,
)
from ssdlocal.core.errors import UsageError


def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts (a batch).")],
    target: o.Target = None,
    draft: o.Draft = None,
    pair: o.PairName = None,
    mode: o.ModeName = "auto",
    k: o.K = 4,
    temperature: o.Temperature = 0.0,
    top_k: o.TopK = 0,
    top_p: o.TopP = 1.0,
    seed: o.Seed = 0,
    max_new_tokens: o.MaxNewTokens = o.DEFAULT_MAX_NEW_TOKENS,
    ignore_eos: o.IgnoreEos = False,
    stop: o.Stop = None,
    dtype: o.Dtype = "bfloat16",
    quantization: o.Quantization = "auto",
    draft_quantization: o.DraftQuantization = None,
    target_device: o.TargetDevice = "auto",
    draft_device: o.DraftDevice = "auto",
    target_backend: o.TargetBackend = "auto",
    draft_backend: o.DraftBackend = "auto",
    cuda_graphs: o.CudaGraphs = True,
    target_devices: o.TargetDevices = None,
    chat: o.Chat = False,
    num_samples: Annotated[int, typer.Option(help="Independent samples of a single prompt.")] = 1,
    fan_out: o.FanOut = None,
    fan_out_miss: o.FanOutMiss = None,
    saguaro_c: o.SaguaroC = 1.0,
    backup: o.Backup = "auto",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of streaming.")
    ] = False,
) -> None:
    """Generate text, streaming tokens as they are accepted."""
    if num_samples < 1:
        raise UsageError(f"num-samples must be >= 1, got {num_samples}", "use --num-samples 1")
    if num_samples > 1 and len(prompts) != 1:
        raise UsageError("--num-samples needs exactly one prompt", "pass a single prompt")
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt", "pass some text to generate from")
    values = locals()
    params = gather(SamplingOptions, values).params()
    config = engine_config(gather(ModelOptions, values), gather(SpecOptions, values))
    from ssdlocal.cli.render import run_generate

    run_generate(config, list(prompts) * num_samples, params, chat=chat, as_json=as_json)
