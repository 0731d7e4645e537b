"""What a model's weights really are, for people: `int4 from x-q4_k_m.gguf (Q4_K_M)`.

Wherever a dtype is shown (the chat header, `devices`, `serve`, `generate`'s first line)
the weights' format is shown with it: the scheme the torch backend runs (int4, int8, or the
float dtype), or llama.cpp's own GGUF type, and the file it comes from. Reads file
headers only (a GGUF's metadata, a quantized checkpoint's quantization.json): no torch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import DEFAULT_DTYPE, DType, Quantization, scheme_for_gguf_type

SHORT_DTYPES = {DType.BFLOAT16: "bf16", DType.FLOAT16: "fp16", DType.FLOAT32: "fp32"}


def gguf_file_type(path: Path) -> str | None:
    """A GGUF's file type as llama.cpp names it ("Q4_K_M"), None if it records none."""
    from ssdlocal.weights.formats.gguf import GGUFHeader  # numpy only

    file_type = GGUFHeader.read(path).metadata.get("general.file_type")
    if not isinstance(file_type, int):
        return None
    from gguf import LlamaFileType

    with contextlib.suppress(ValueError):
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return None


def weights_format(
    path: str | Path, backend: BackendName, quantization: Quantization, dtype: DType
) -> tuple[str, str | None]:
    """(what runs: "int4" | "int8" | "bf16" | ... | "Q4_K_M (llama.cpp)", the GGUF file type or None)."""
    path = Path(path).expanduser()
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    file_type = None
    if is_gguf:
        with contextlib.suppress(Exception):  # a label must never fail a run
            file_type = gguf_file_type(path)
    if BackendName(backend).runs_gguf:
        return f"{file_type or 'GGUF'} (llama.cpp)", file_type
    scheme = Quantization(quantization)
    if scheme is Quantization.AUTO:
        if is_gguf:
            scheme = scheme_for_gguf_type(file_type) if file_type else _gguf_scheme(path)
        else:
            scheme = _checkpoint_scheme(path)
    return (SHORT_DTYPES.get(dtype, dtype) if scheme is Quantization.NONE else scheme), file_type


def weights_label(
    path: str | Path,
    backend: BackendName = BackendName.TORCH,
    quantization: Quantization = Quantization.NONE,
    dtype: DType = DEFAULT_DTYPE,
) -> str:
    """`int4 from qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (Q4_K_M)`, `bf16 from Qwen2.5-0.5B`."""
    fmt, file_type = weights_format(path, backend, quantization, dtype)
    name = Path(path).name or str(path)
    if not BackendName(backend).runs_gguf and file_type:
        return f"{fmt} from {name} ({file_type})"
    return f"{fmt} from {name}"


def spec_label(spec) -> str:
    """weights_label of a core.models.ModelSpec."""
    return weights_label(spec.path, spec.backend, spec.quantization, spec.dtype)


def _gguf_scheme(path: Path) -> Quantization:
    from ssdlocal.weights.formats.gguf import gguf_scheme

    try:
        return gguf_scheme(path)
    except ImportError:  # the gguf package is not installed: llama.cpp runs the file
        return Quantization.NONE


def _checkpoint_scheme(path: Path) -> Quantization:
    """A quantized checkpoint's scheme (its quantization.json), none for float ones."""
    from ssdlocal.weights.formats.quantized import quant_info

    info = quant_info(path)
    return Quantization(info.get("scheme", Quantization.NONE)) if info else Quantization.NONE
