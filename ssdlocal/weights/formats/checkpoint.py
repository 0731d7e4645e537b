"""A checkpoint's files before any weights are read: its config, tokenizer and weight files.

A model path is a Hugging Face checkpoint directory (config.json, tokenizer files,
*.safetensors) or a .gguf file, whose config and tokenizer come from its metadata
directory (metadata.py) without converting any weights. Every path is checked first
(checks.py); a file that cannot be read is reported with what to do about it: a cache
entry ssdlocal built is deleted and built again, the user's own files are never deleted.
Imports no torch (transformers reads the config and the tokenizer).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.quantization import DType
from ssdlocal.weights.formats.archs import find, unsupported
from ssdlocal.weights.formats.checks import (
    PATH_HINT,
    check_config,
    check_model_path,
    read_config_json,
    require_regular,
)

CHECKPOINT_HINT = PATH_HINT


def checked(path: str | Path) -> Path:
    """`path` (user home expanded) once it can be a model (checks.check_model_path)."""
    return check_model_path(Path(path).expanduser())


def is_cache_entry(path: Path) -> bool:
    """Whether `path` is a checkpoint ssdlocal built from a GGUF file (float or quantized)."""
    from ssdlocal.weights.formats.convert import is_conversion
    from ssdlocal.weights.formats.quantized import is_quantized_cache

    return is_conversion(path) or is_quantized_cache(path)


def config_dir(path: str | Path) -> Path:
    """A directory with the config and tokenizer of `path`, converting no weights
    (a .gguf file's metadata is extracted once into a small cached directory)."""
    path = checked(path)
    if path.is_file():
        from ssdlocal.core.paths import cache_dir
        from ssdlocal.weights.formats.convert import CONVERTED_MARKER, converted_dir
        from ssdlocal.weights.formats.metadata import metadata_dir

        if (cache_dir() / "converted").is_dir():  # hashing the file for its key writes there
            for dtype in DType:  # a float conversion has them too
                if (converted_dir(path, dtype) / CONVERTED_MARKER).is_file():
                    return converted_dir(path, dtype)
        return metadata_dir(path)
    return path


def damaged_hint(ckpt: Path) -> str:
    """What to do about an unreadable file in checkpoint `ckpt`: a cache entry ssdlocal
    wrote is deleted and built again; anything else is the user's, and is never deleted."""
    if is_cache_entry(ckpt):
        return f"the cached conversion is damaged: delete {ckpt} and rerun (it is converted again)"
    return (
        f"the file is damaged or incomplete: replace the model at {ckpt} with a good copy "
        "(a pulled pair: `ssdlocal pull PAIR` fetches it again)"
    )


def load_hf_config(path: Path):
    """transformers' config of checkpoint `path`. A model_type transformers does not know
    is read with the config class of its description's `config_type`, if it has one."""
    from transformers import AutoConfig

    raw = read_config_json(path / "config.json", damaged_hint(path))  # bounded, no FIFO, no deep nesting
    check_config(raw, path / "config.json", _config_hint(path))
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:  # unknown model_type: name it from the raw json
        described = find(raw.get("architectures"), raw.get("model_type"))
        if described is not None and described.config_type:
            fields = {k: v for k, v in raw.items() if k != "model_type"}
            return AutoConfig.for_model(described.config_type, **fields)
        if described is not None:
            raise ModelLoadError(
                f"{path / 'config.json'} is not a valid {described.name} config: {first_line(exc)}",
                hint=_config_hint(path),
            ) from exc
        archs = raw.get("architectures")
        names = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else str(raw.get("model_type"))
        raise unsupported(f"architecture {names[:200] if names != 'None' else 'unknown'}") from exc
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise TypeError, ZeroDivisionError, ...
        raise ModelLoadError(
            f"{path / 'config.json'} is not a valid model config: {first_line(exc)}", hint=_config_hint(path)
        ) from exc


def _config_hint(path: Path) -> str:
    return f"fix {path / 'config.json'}, or use the model's original config.json"


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (no weights are read)."""
    from transformers import AutoTokenizer

    path = config_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        hint = "the directory needs tokenizer.json / tokenizer_config.json"
        if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
            hint = damaged_hint(path)
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {first_line(exc)}", hint=hint) from exc


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of checkpoint directory `path`: those its index names (all
    present, all inside `path`), else every *.safetensors; each a regular file."""
    index = path / "model.safetensors.index.json"
    if index.is_file() or index.is_symlink():
        weight_map = read_config_json(index, damaged_hint(path)).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index} has no weight_map of tensor names to files", hint=damaged_hint(path))
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        if any(Path(name).name != name for name in dict.fromkeys(weight_map.values())):
            raise ModelLoadError(f"{index} names files outside {path}", hint=damaged_hint(path))
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(
                f"{path} is missing shards: {', '.join(missing[:5])}",
                hint="the download is incomplete; pull the model again",
            )
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights", hint=CHECKPOINT_HINT)
    for file in files:
        require_regular(file, f"replace {file} with the model's weight file")
    return files


MTP_PREFIX = "mtp."  # multi-token-prediction tensors (Qwen3.5 checkpoints): the target skips them


def mtp_tensor_names(path: str | Path) -> list[str]:
    """The multi-token-prediction tensors (`mtp.*`) checkpoint directory `path` holds, by
    name, from its index or its safetensors headers (no weights read); [] for a path that
    is no checkpoint directory or holds none."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return []
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text()).get("weight_map") or {})
        else:
            names = []
            for file in sorted(path.glob("*.safetensors")):
                with open(file, "rb") as fh:
                    (size,) = struct.unpack("<Q", fh.read(8))
                    names += list(json.loads(fh.read(min(size, _MAX_HEADER))))
    except (OSError, ValueError, AttributeError, struct.error):
        return []
    return sorted(n for n in names if isinstance(n, str) and n.startswith(MTP_PREFIX))


_MAX_HEADER = 100 << 20  # bytes of a safetensors header read at most


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), at most
    300 characters: what error messages quote of a library's error."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
