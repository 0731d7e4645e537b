"""What a checkpoint's files must be before anything is built from them.

Model paths are directories or regular files (a FIFO would block the open forever, a
device would stream without end); config.json is a bounded JSON object whose sizes are
positive integers that divide as the model needs; and the sizes it declares must agree
with the weight files' headers (layers, vocabulary, hidden size, parameter count) and
fit the memory, so a hostile or broken config is refused in milliseconds instead of
building a million layers or allocating terabytes. Reads headers only; imports no model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from math import prod
from pathlib import Path

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.files import kind_of

MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few KB; refuse reading more than this
MAX_SIZE = 1 << 31  # no size in a config reaches this (the largest vocabularies are ~1M)
CONFIG_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")  # may be null: derived from the others
PATH_HINT = (
    "point --target (or --draft) at a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file"
)


def check_model_path(path: Path) -> Path:
    """`path` itself if it can be a model: a directory with a regular config.json, or a
    regular .gguf file. Anything else is a ModelLoadError saying what it is."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist", hint=PATH_HINT)
    if (kind := kind_of(path)) is not None:
        raise ModelLoadError(f"{path} is {kind}, not a model directory or a model file", hint=PATH_HINT)
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf file", hint=PATH_HINT)
    if path.is_dir():
        for entry in path.iterdir():  # config, tokenizer, weights: whatever a loader may open
            if (kind := kind_of(entry)) is not None:
                raise ModelLoadError(f"{entry} is {kind}, not a file", hint=f"replace {entry} with the model's file")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json", hint=PATH_HINT)
    return path


def require_regular(path: Path, hint: str) -> None:
    """Refuse to open `path` unless it is a regular file (a FIFO blocks the open)."""
    if (kind := kind_of(path)) is not None:
        raise ModelLoadError(f"{path} is {kind}, not a file", hint=hint)


def read_config_json(path: Path, hint: str) -> dict:
    """config.json as a dict: a regular file of at most MAX_CONFIG_BYTES holding one JSON
    object (any nesting the parser takes; deeper is an error, not a crash)."""
    require_regular(path, hint)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}", hint=hint) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB: not a model config", hint=hint)
    try:
        config = json.loads(raw)
    except RecursionError:
        raise ModelLoadError(f"{path} is nested too deeply to be a model config", hint=hint) from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise ModelLoadError(f"{path} is not valid JSON: {str(exc)[:200]}", hint=hint) from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(config).__name__}", hint=hint)
    return config


def text_part(config: dict) -> dict:
    """The part of config.json `config` that describes the text model: a multimodal
    checkpoint's `text_config`, else the whole."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def check_config(config: dict, path: Path, hint: str) -> None:
    """The sizes transformers and the model would trip over (a string, a negative or zero
    size, heads that do not divide), refused with the field's name (a multimodal
    checkpoint's: its text model's)."""
    config = text_part(config)
    for key in CONFIG_SIZES:
        value = config.get(key)
        if value is None and (key in OPTIONAL_SIZES or key not in config):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_SIZE:
            shown = json.dumps(value)[:40] if _jsonable(value) else type(value).__name__
            raise ModelLoadError(f"{path}: {key} must be a positive integer below {MAX_SIZE:,}, got {shown}", hint=hint)
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelLoadError(
            f"{path}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})", hint=hint
        )
    hidden = config.get("hidden_size")
    if heads and hidden and not config.get("head_dim") and hidden % heads:
        raise ModelLoadError(
            f"{path}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})", hint=hint
        )


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def check_against_weights(
    args, declared: Callable[[], int], arch, headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]], ckpt: Path
) -> None:
    """The config's sizes (`args`: layers, vocabulary, width; `declared()`: the parameters a
    model of that config has, asked only once the layers and embedding agree) against the
    weight files' headers (file -> tensor -> (dtype, shape)): the same number of layers,
    the embedding's rows and width, and no more parameters than the files hold (int4 codes
    count two per byte)."""
    layers, held, embedding = set(), 0, None
    stored = (  # (our name, dtype, shape); a packed tensor (MXFP4 experts) as the ones it holds
        (ours, dtype, shape)
        for tensors in headers.values()
        for name, (dtype, packed) in tensors.items()
        for ours, shape in arch.checkpoint_shapes(name, packed).items()
    )
    for ours, dtype, shape in stored:
        if ours.startswith("layers.") and ours.split(".")[1].isdigit():
            layers.add(int(ours.split(".")[1]))
        leaf = ours.rpartition(".")[2]
        if leaf in ("scales", "zeros"):
            continue
        held += prod(shape) * (2 if leaf == "codes" and dtype == "U8" else 1)
        if ours in ("embed_tokens.weight", "embed_tokens.codes"):
            embedding = (leaf, dtype, shape)
    hint = (
        "the config.json does not describe these weights: it may belong to another model, "
        "or have been edited; use the model's own config.json"
    )
    if len(layers) != args.num_layers:
        raise ModelLoadError(
            f"{ckpt}: config.json declares {args.num_layers:,} layers, the weight files hold {len(layers):,}", hint=hint
        )
    if embedding is not None:
        leaf, dtype, shape = embedding
        width = shape[-1] * (2 if leaf == "codes" and dtype == "U8" else 1) if len(shape) == 2 else None
        if len(shape) != 2 or shape[0] != args.vocab_size or (leaf == "weight" and width != args.hidden_size):
            raise ModelLoadError(
                f"{ckpt}: config.json declares a vocabulary of {args.vocab_size:,} x "
                f"{args.hidden_size:,}, the embedding in the weight files is "
                f"{' x '.join(f'{d:,}' for d in shape)}",
                hint=hint,
            )
    params = declared()
    if params > held * 1.01 + 4096:
        raise ModelLoadError(
            f"{ckpt}: config.json declares about {params:,} parameters, the weight files hold {held:,}", hint=hint
        )
