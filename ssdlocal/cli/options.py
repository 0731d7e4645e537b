"""Every CLI option, declared once as an `Annotated` alias; commands only list them.

Commands that run a model take the same model, device, backend, speculation and
sampling options with the same help text, so `generate`, `chat`, `race`, `bench` and
`check` cannot drift apart. Parsing and validation live in resolve.py, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --------------------------------------------------------------------------- models
Target = Annotated[
    str | None,
    typer.Option(help="Target checkpoint dir or .gguf file. Default: the offline Qwen2.5-Coder 1.5B."),
]
Draft = Annotated[
    str | None,
    typer.Option(help="Draft checkpoint dir, .gguf file, or 'ngram'. Default: Qwen2.5-Coder 0.5B."),
]
PairName = Annotated[
    str | None,
    typer.Option("--pair", help="A registry pair (see `ssdlocal pairs`) instead of --target/--draft."),
]
Dtype = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
TargetDevice = Annotated[
    str, typer.Option(help="auto | cpu | cuda | cuda:N (auto: the GPUs when present, else the CPU).")
]
DraftDevice = Annotated[
    str,
    typer.Option(help="auto | cpu | cuda | cuda:N (auto: a free GPU, else the target's, else the CPU)."),
]
TargetDevices = Annotated[
    str | None,
    typer.Option(
        help="Tensor-parallel target over these devices, e.g. cuda:0-3 (overrides "
        "--target-device); auto = the planner's target and draft devices."
    ),
]
Quantization = Annotated[
    str,
    typer.Option(
        help="Weights (torch backend): none | int8 | int4 | auto. auto = a GGUF's own class "
        "(Q4_*/Q5_* -> int4, Q8_0/Q6_K -> int8, F16/BF16/F32 -> none); safetensors -> none."
    ),
]
DraftQuantization = Annotated[
    str | None, typer.Option(help="Draft weights when they differ from --quantization.")
]
TargetBackend = Annotated[
    str,
    typer.Option(
        help="auto | torch | llamacpp (auto: llama.cpp for a .gguf target on a CPU-only run "
        "when llama-cpp-python is installed, else torch)."
    ),
]
DraftBackend = Annotated[
    str, typer.Option(help="auto | torch | llamacpp (auto: the target's, for a .gguf draft).")
]
CudaGraphs = Annotated[
    bool,
    typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="Capture each decode step shape as a CUDA graph (GPUs only; off: eager kernels).",
    ),
]

# --------------------------------------------------------------------------- speculation
ModeName = Annotated[
    str,
    typer.Option(
        "--mode",
        help="auto | ar | sd | ssd (auto: SSD when the draft has hardware of its own, SD when "
        "it shares the target's GPU, on a CPU-only machine whichever a calibration predicts "
        "fastest, AR without a draft).",
    ),
]
K = Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K), 1 to 32.")]
FanOut = Annotated[
    str | None,
    typer.Option(
        help="SSD fan-out per accepted length after a hit, e.g. 3,3,2,2,1 (at most 256 in "
        "all), or auto."
    ),
]
FanOutMiss = Annotated[str | None, typer.Option(help="SSD fan-out after a miss, or auto.")]
SaguaroC = Annotated[float, typer.Option(help="Saguaro sampling constant C in (0, 1].")]
Backup = Annotated[str, typer.Option(help="SSD backup on a miss: auto | jit | ngram | none")]

# --------------------------------------------------------------------------- sampling
Temperature = Annotated[
    float,
    typer.Option(help="0 = greedy; otherwise at least 1e-4 (tinier values are refused: use 0)."),
]
TopK = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")]
Seed = Annotated[
    int,
    typer.Option(
        help="Random seed, 0 to 2^64-1. AR/SD samples are reproducible; SSD samples too with a fixed "
        "--fan-out and --backup other than auto (adaptive schedules follow timing)."
    ),
]
# generate, chat and serve share one default: an answer runs to its end (end-of-sequence or
# a stop string), bounded by the model's context; bench, check and race measure a fixed count.
DEFAULT_MAX_NEW_TOKENS: int | None = None
MaxNewTokens = Annotated[
    int | None,
    typer.Option(
        help="Cap on new tokens per answer. Default: until end-of-sequence, bounded by the "
        "model's context."
    ),
]
FixedNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")]
IgnoreEos = Annotated[bool, typer.Option(help="Keep generating past end-of-sequence.")]
Stop = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")]

# --------------------------------------------------------------------------- output
Chat = Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Backend = Annotated[str, typer.Option(help="torch | llamacpp")]
OutDir = Annotated[Path | None, typer.Option(help="Output directory. Default: bench-out/<timestamp>.")]
