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
TargetDevice = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
DraftDevice = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
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
    str, typer.Option(help="torch | llamacpp (llamacpp runs a .gguf target through llama.cpp)")
]
DraftBackend = Annotated[
    str, typer.Option(help="torch | llamacpp (llamacpp runs a .gguf draft through llama.cpp)")
]

# --------------------------------------------------------------------------- speculation
ModeName = Annotated[str, typer.Option("--mode", help="ar | sd | ssd")]
K = Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K).")]
FanOut = Annotated[
    str | None,
    typer.Option(help="SSD fan-out per accepted length after a hit, e.g. 3,3,2,2,1, or auto."),
]
FanOutMiss = Annotated[str | None, typer.Option(help="SSD fan-out after a miss, or auto.")]
SaguaroC = Annotated[float, typer.Option(help="Saguaro sampling constant C in (0, 1].")]
Backup = Annotated[str, typer.Option(help="SSD backup on a miss: auto | jit | ngram | none")]

# --------------------------------------------------------------------------- sampling
Temperature = Annotated[float, typer.Option(help="0 = greedy.")]
TopK = Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")]
Seed = Annotated[
    int,
    typer.Option(
        help="Random seed. AR/SD samples are reproducible; SSD samples too with a fixed "
        "--fan-out and --backup other than auto (adaptive schedules follow timing)."
    ),
]
MaxNewTokens = Annotated[int, typer.Option(help="Tokens to generate per prompt.")]
IgnoreEos = Annotated[bool, typer.Option(help="Keep generating past end-of-sequence.")]
Stop = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")]

# --------------------------------------------------------------------------- output
Chat = Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Backend = Annotated[str, typer.Option(help="torch | llamacpp")]
OutDir = Annotated[Path | None, typer.Option(help="Output directory. Default: bench-out/<timestamp>.")]
