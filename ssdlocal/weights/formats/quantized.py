"""What a quantized checkpoint is, as files, and what `--quantization` means for a path.

A quantized checkpoint (the torch backend's cache of a GGUF file's int8 / int4 weights) is
a checkpoint directory holding `quantization.json` (scheme, group size, dtype, source,
sha256, tensor counts) beside config, tokenizer and one model.safetensors of codes, scales
and float tensors; a cache entry ssdlocal built also holds its marker, written last. This
module reads those files only: building one is the backend's job. Imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from ssdlocal.core.errors import UsageError
from ssdlocal.core.quantization import Quantization
from ssdlocal.weights.formats.gguf import gguf_scheme

QUANT_FILE = "quantization.json"  # in a quantized checkpoint: scheme, group size, dtype, source
QUANTIZED_MARKER = "ssdlocal-quantize.json"  # written last into a quantized cache entry


def is_quantized_cache(path: Path) -> bool:
    """Whether `path` is a quantized checkpoint ssdlocal built (a cache entry)."""
    return (Path(path) / QUANTIZED_MARKER).is_file()


def quant_info(path: Path) -> dict | None:
    """quantization.json of a quantized checkpoint directory, None for anything else."""
    try:
        return json.loads((Path(path) / QUANT_FILE).read_text())
    except (OSError, ValueError):
        return None


def resolve_scheme(path: str | Path, quantization: Quantization) -> Quantization:
    """none | int8 | int4 for `path`: `auto` is a GGUF's own class, a quantized
    checkpoint's scheme, and none for float checkpoints. Validates the combination."""
    quantization = Quantization.parse(quantization, "quantization")
    path = Path(path).expanduser()
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    info = None if is_gguf or not path.is_dir() else quant_info(path)
    held = Quantization.parse(info.get("scheme", ""), f"scheme in {path / QUANT_FILE}") if info else None
    if quantization is Quantization.AUTO:
        if is_gguf:
            return gguf_scheme(path)
        return held or Quantization.NONE
    if held is not None and held is not quantization:
        raise UsageError(
            f"{path} holds {info.get('scheme')} weights, not {quantization}",
            f"use --quantization auto (or {info.get('scheme')}), or point at the float checkpoint",
        )
    return quantization
