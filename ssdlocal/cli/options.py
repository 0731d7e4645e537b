"""The options of every command that runs a model, declared and defaulted once.

Three frozen option groups (ModelOptions, SpecOptions, SamplingOptions) whose fields carry
their flag, help text and default (the core config's own default where it has one). `COMMANDS` says, in one table, which of them each
command takes and where a command differs (check's float32, a fixed token count, ...);
`@model_command(name)` builds the command's signature from that for Typer and hands the
command typed option objects. Parsing and validation of the values live in resolve.py.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from ssdlocal.core.config import (
    ADAPTIVE_K_MAX,
    BACKUPS,
    MAX_FAN_OUT_TOTAL,
    MAX_K,
    PREFIX_CACHE_TOKENS,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.models import BackendName, MemorySettings
from ssdlocal.core.models import DEFAULT_DTYPE, DTYPES
from ssdlocal.core.quantization import DType, Quantization

_OPTION = "typer.Option"  # key of a field's metadata: its flag(s) and help


def option(default: Any, help: str, *flags: str, metavar: str | None = None) -> Any:
    """A dataclass field that is also a command-line option: its default and typer.Option
    (`metavar`: what --help calls its value, e.g. PATH; default: its type, e.g. TEXT)."""
    return field(default=default, metadata={_OPTION: typer.Option(*flags, help=help, metavar=metavar)})


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelOptions:
    """Which models, where, on which backend and with which weights. The dtype and the
    quantizations arrive as the user's text and are parsed into their choices (DType,
    Quantization) when the group is made, before anything is fetched."""

    target: str | None = option(None, "Target checkpoint dir or .gguf file. Default: the offline Qwen2.5-Coder 1.5B.")
    draft: str | None = option(
        None,
        "Draft checkpoint dir, .gguf file, draft head dir, 'ngram' (prompt lookup), 'suffix' (the row's "
        "tokens and earlier prompts and answers) or 'mtp' (the target checkpoint's own MTP layer). "
        "Default: Qwen2.5-Coder 0.5B.",
    )
    pair: str | None = option(None, "A registry pair (see `ssdlocal pairs`) instead of --target/--draft.", "--pair")
    # the user's words (Typer passes text); __post_init__ parses dtype and the quantizations
    dtype: str = option(DEFAULT_DTYPE, " | ".join(DTYPES))
    quantization: str = option(
        "auto",
        "Weights (torch backend): none | int8 | int4 | auto. auto = a GGUF's own class "
        "(Q4_*/Q5_* -> int4, Q8_0/Q6_K -> int8, F16/BF16/F32 -> none); safetensors -> none.",
    )
    draft_quantization: str | None = option(  # None: as --quantization
        None, "Draft weights when they differ from --quantization."
    )
    target_device: str = option("auto", "auto | cpu | cuda | cuda:N (auto: the GPUs when present, else the CPU).")
    draft_device: str = option(
        "auto", "auto | cpu | cuda | cuda:N (auto: a free GPU, else the target's, else the CPU)."
    )
    target_devices: str | None = option(
        None,
        "Tensor-parallel target over these devices, e.g. cuda:0-3 (overrides --target-device); "
        "auto = the planner's target and draft devices.",
    )
    target_backend: str = option(
        "auto",
        "auto | torch | llamacpp (auto: llama.cpp for a .gguf target on a CPU-only run when "
        "llama-cpp-python is installed, else torch).",
    )
    draft_backend: str = option("auto", "auto | torch | llamacpp (auto: the target's, for a .gguf draft).")
    cuda_graphs: bool = option(
        True,
        "Capture each decode step shape as a CUDA graph (GPUs only; off: eager kernels).",
        "--cuda-graphs/--no-cuda-graphs",
    )
    batch_invariant: bool = option(
        False,
        "llama.cpp target on the CPU: decode steps only in call widths whose logits llama.cpp "
        "computes alike, each call from an empty cache (no prefix cache), so greedy AR, SD and "
        "SSD of one request agree bit for bit (without it they can part at near-ties); steps "
        "cost more (checked at the first step, ~1 s).",
        "--batch-invariant/--no-batch-invariant",
    )
    prefix_cache: bool = option(
        True,
        "Reuse the KV of the longest prefix earlier calls left (chat turns, re-sent files): "
        "a prompt is read from where they diverge. generate, which answers once and exits, "
        "keeps none unless --prefix-cache-tokens is given.",
        "--prefix-cache/--no-prefix-cache",
    )
    prefix_cache_tokens: int | None = option(
        None,
        f"Tokens of earlier prompts and answers each model keeps in the prefix cache "
        f"(default: {PREFIX_CACHE_TOKENS}, at most a tenth of the memory free after loading).",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype, "--dtype"))
        object.__setattr__(self, "quantization", Quantization.parse(self.quantization, "--quantization"))
        if self.draft_quantization is not None:
            draft = Quantization.parse(self.draft_quantization, "--draft-quantization")
            object.__setattr__(self, "draft_quantization", draft)

    def quantizations(self, backends: tuple[BackendName, BackendName]) -> tuple[Quantization, Quantization]:
        """(target, draft) weight quantization; a draft whose backend runs GGUF files as
        they are (llama.cpp) keeps its GGUF's own."""
        draft = self.draft_quantization
        if draft is None:
            draft = Quantization.AUTO if BackendName(backends[1]).runs_gguf else self.quantization
        return self.quantization, draft


# --------------------------------------------------------------------------- speculation
@dataclass(frozen=True)
class SpecOptions:
    """Speculation settings as typed on the command line."""

    mode: str = option(
        "auto",
        "auto | ar | sd | ssd (auto: SSD when the draft has hardware of its own, SD when it "
        "shares the target's GPU, on a CPU-only machine whichever a calibration predicts "
        "fastest, AR without a draft).",
        "--mode",
    )
    k: int | None = option(
        None,
        f"Draft tokens per round (lookahead K), 1 to {MAX_K}. Default: SD chooses K each round "
        f"(0 to {ADAPTIVE_K_MAX}; 0 = a plain step) from measured costs and acceptance; SSD uses "
        f"{SpecConfig.k}.",
        "--k",
    )
    fan_out: str | None = option(
        None,
        f"SSD fan-out per accepted length after a hit, e.g. 3,3,2,2,1 (at most {MAX_FAN_OUT_TOTAL} in all), or auto.",
    )
    fan_out_miss: str | None = option(None, "SSD fan-out after a miss, or auto.")
    saguaro_c: float = option(SpecConfig.saguaro_c, "Saguaro sampling constant C in (0, 1].")
    backup: str = option(
        SpecConfig.backup.value,
        f"SSD backup on a miss: {' | '.join(BACKUPS)} (suffix also caches a branch for its own guess of the bonus)",
    )
    suffix: bool = option(
        True,
        "SD with a draft model: a row takes its suffix proposal (its own tokens and earlier "
        "prompts and answers) instead when that predicts more accepted tokens.",
        "--suffix/--no-suffix",
    )
    suffix_memory_tokens: int = option(
        MemorySettings.max_tokens,
        "Tokens of earlier prompts and answers the suffix proposals remember (0: none).",
    )
    persist_suffix_memory: bool = option(
        False,
        "Keep the suffix memory under the cache directory (one file per target model) and load it next time.",
        "--persist-suffix-memory/--no-persist-suffix-memory",
    )


# --------------------------------------------------------------------------- sampling
# generate, chat and serve share one default: an answer runs to its end (end-of-sequence or
# a stop string), bounded by the model's context; bench, check and race measure a fixed count.
DEFAULT_MAX_NEW_TOKENS: int | None = None


@dataclass(frozen=True)
class SamplingOptions:
    """How tokens are drawn and where an answer ends."""

    temperature: float = option(
        SamplingParams.temperature, "0 = greedy; otherwise at least 1e-4 (tinier values are refused: use 0)."
    )
    top_k: int = option(SamplingParams.top_k, "Keep the k most likely tokens (0 = off).")
    top_p: float = option(SamplingParams.top_p, "Nucleus sampling mass in (0, 1].")
    seed: int = option(
        SamplingParams.seed,
        "Random seed, 0 to 2^64-1. AR/SD samples are reproducible; SSD samples too with a fixed "
        "--fan-out and --backup other than auto (adaptive schedules follow timing).",
    )
    max_new_tokens: int | None = option(
        DEFAULT_MAX_NEW_TOKENS,
        "Cap on new tokens per answer. Default: until end-of-sequence, bounded by the model's context.",
    )
    ignore_eos: bool = option(SamplingParams.ignore_eos, "Keep generating past end-of-sequence.")
    stop: list[str] | None = option(None, "Stop string (repeatable).")  # noqa: RUF009 - a field()

    def params(self) -> SamplingParams:
        """The validated SamplingParams (UsageError with a hint on a bad value)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_new_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            stop=tuple(self.stop or ()),
        )


GROUPS = (ModelOptions, SpecOptions, SamplingOptions)

# --------------------------------------------------------------------------- per command
_SAME = object()  # Change: keep the shared default


@dataclass(frozen=True)
class Change:
    """A command's own default and/or help for one shared option (the rest is shared)."""

    default: Any = _SAME
    help: str | None = None


def _fixed_tokens(count: int) -> Change:
    """bench, check and race measure a fixed number of tokens per prompt."""
    return Change(count, "Tokens to generate per prompt.")


@dataclass(frozen=True)
class Takes:
    """The shared options one command takes: every field of the groups it asks for, less
    `drop`, with `change` giving this command its own default or help for a field."""

    drop: frozenset[str] = frozenset()
    change: dict[str, Change] = field(default_factory=dict)

    def fields(self, group: type) -> list[Field]:
        return [f for f in fields(group) if f.name not in self.drop]


_DRAWING = frozenset({"temperature", "top_k", "top_p", "seed"})  # how each token is drawn
_ENDING = frozenset({"ignore_eos", "stop"})  # where an answer ends besides its length

COMMANDS: dict[str, Takes] = {
    "generate": Takes(),
    # a chat answer ends at the end of its turn; the mode can change while chatting
    "chat": Takes(drop=_ENDING, change={"mode": Change(help="Starting mode: auto | ar | sd | ssd (F2 switches).")}),
    # race runs AR, SD and SSD, bench its --modes: neither has one --mode
    "race": Takes(drop=_ENDING | {"mode"}, change={"max_new_tokens": _fixed_tokens(128)}),
    "bench": Takes(
        drop=frozenset({"mode", "stop"}),
        change={
            "temperature": Change(help="0 = greedy (exactness is checked against AR)."),
            "max_new_tokens": _fixed_tokens(128),
        },
    ),
    # check: greedy AR, SD and SSD on a fixed count, in float32 unless told (exact there)
    "check": Takes(
        drop=_DRAWING | _ENDING | {"mode", "saguaro_c"},
        change={
            "dtype": Change("float32", "float32 (must be identical) | bfloat16 | float16"),
            "max_new_tokens": _fixed_tokens(32),
        },
    ),
    # a request carries its own sampling; --max-new-tokens caps every answer
    "serve": Takes(drop=_DRAWING | _ENDING),
}


def model_command(name: str):
    """Decorator: give command `name` the shared options COMMANDS[name] lists.

    Each parameter of the command annotated with an option group is replaced, in place,
    by that group's options (one keyword parameter per field, named like the field); when
    Typer calls the command, their values become one group object passed under the
    parameter's name. Fields a command does not take keep the group's default.
    """
    takes = COMMANDS[name]

    def decorate(func):
        hints = get_type_hints(func, include_extras=True)
        own = inspect.signature(func).parameters.values()
        groups = {p.name: hints[p.name] for p in own if hints.get(p.name) in GROUPS}
        _check(name, takes, [p.name for p in own if p.name not in groups], groups.values())
        params = []
        for p in own:
            if p.name in groups:
                params += _parameters(groups[p.name], takes)
            else:
                params.append(p.replace(kind=p.KEYWORD_ONLY, annotation=hints[p.name]))

        @functools.wraps(func)
        def command(**values):
            for param, group in groups.items():
                values[param] = group(**{f.name: values.pop(f.name) for f in takes.fields(group)})
            return func(**values)

        command.__signature__ = inspect.Signature(params, return_annotation=None)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _parameters(group: type, takes: Takes) -> list[inspect.Parameter]:
    """One keyword parameter per option of `group` the command takes: Annotated[type, Option]."""
    hints = get_type_hints(group)
    params = []
    for f in takes.fields(group):
        info, default = _named(f), f.default
        change = takes.change.get(f.name)
        if change is not None:
            info = copy.copy(info)
            info.help = change.help or info.help
            default = f.default if change.default is _SAME else change.default
        annotation = Annotated[hints[f.name], info]
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def _check(name: str, takes: Takes, own: list[str], groups) -> None:
    """A misspelt or clashing option name fails when the command is defined, not later."""
    shared = {f.name for group in groups for f in fields(group)}
    unknown = (takes.drop | set(takes.change)) - shared
    if unknown:
        raise TypeError(f"COMMANDS[{name!r}] names no option of its groups: {sorted(unknown)}")
    if takes.drop & set(takes.change):
        raise TypeError(f"COMMANDS[{name!r}] changes options it drops: {sorted(takes.drop & set(takes.change))}")
    if shared & set(own):
        raise TypeError(f"command {name!r} declares shared options itself: {sorted(shared & set(own))}")


def annotated(group: type, name: str):
    """A shared option as an Annotated type, for a command outside COMMANDS that takes it
    (its default: the group's class attribute, e.g. ModelOptions.quantization)."""
    (found,) = [f for f in fields(group) if f.name == name]
    return Annotated[get_type_hints(group)[name], _named(found)]


# what --help calls the value of each shared option (the rest show their type: TEXT, ...)
METAVARS = {
    "target": "PATH",
    "draft": "PATH",
    "pair": "NAME",
    "dtype": "DTYPE",
    "quantization": "SCHEME",
    "draft_quantization": "SCHEME",
    "target_device": "DEVICE",
    "draft_device": "DEVICE",
    "target_devices": "DEVICES",
    "target_backend": "BACKEND",
    "draft_backend": "BACKEND",
    "mode": "MODE",
    "k": "K",
    "fan_out": "F0,F1,...",
    "fan_out_miss": "F0,F1,...",
    "saguaro_c": "C",
    "backup": "KIND",
    "suffix_memory_tokens": "N",
    "temperature": "T",
    "top_k": "K",
    "top_p": "P",
    "seed": "N",
    "max_new_tokens": "N",
    "stop": "TEXT",
}


def _named(f: Field):
    """A field's typer.Option with its METAVARS name (a copy: the field's own is shared)."""
    info = f.metadata[_OPTION]
    if info.metavar is None and f.name in METAVARS:
        info = copy.copy(info)
        info.metavar = METAVARS[f.name]
    return info


QuantizationOption = annotated(ModelOptions, "quantization")  # `devices` plans with it

# --------------------------------------------------------------------------- output
# Options some commands declare themselves (their defaults differ by command).
Chat = Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streamed text or tables.")]
OutDir = Annotated[Path | None, typer.Option(help="Output directory. Default: bench-out/<timestamp>.")]
