"""Weight quantization names and sizes, free of torch: what `--quantization` accepts, which
scheme a GGUF type name maps to, and how many bytes a parameter takes under each scheme.

The quantized kernels and the quantizer live in the torch backend, what a quantized
checkpoint is as files in ssdlocal.weights.formats; this module only knows names and
arithmetic.
"""

from __future__ import annotations

from ssdlocal.core.errors import UsageError

QUANTIZATIONS = ("none", "int8", "int4", "auto")
SCHEMES = ("none", "int8", "int4")  # what `auto` resolves to
INT4_GROUP = 32  # int4 weights carry one (scale, zero) pair per 32 input features
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per value of each activation dtype


def check_quantization(value: str, what: str = "quantization") -> str:
    """`value` if it is one of QUANTIZATIONS, else UsageError."""
    if value not in QUANTIZATIONS:
        raise UsageError(f"unknown {what} {value!r}", f"choose one of: {', '.join(QUANTIZATIONS)}")
    return value


def can_quantize(shape: tuple[int, ...], scheme: str) -> bool:
    """Whether a weight of `shape` (a matrix, or a stack of expert matrices: the last two
    dims) takes `scheme`: int4 needs whole groups along the input features; int8 any matrix."""
    if len(shape) not in (2, 3):
        return False
    return scheme == "int8" or (scheme == "int4" and shape[-1] % INT4_GROUP == 0)


def gguf_embedding_scheme(exact_int4: bool, shape: tuple[int, ...], scheme: str) -> str:
    """How the torch backend keeps a GGUF's token embedding, quantized in the file already:
    int4 where its values are int4 already (Q4_0/Q4_1/Q4_K, `exact_int4`: exact) and the
    scheme is int4, int8 rows otherwise (finer than the 5- and 6-bit types it comes from)."""
    return "int4" if scheme == "int4" and exact_int4 and can_quantize(shape, "int4") else "int8"


def scheme_for_gguf_type(type_name: str) -> str:
    """The scheme `auto` picks for a GGUF file or tensor type name (e.g. "Q4_K_M", "MOSTLY_Q8_0").

    4- and 5-bit types (and anything coarser) -> int4; Q6_K / Q8_* -> int8; floats -> none.
    """
    name = type_name.upper().removeprefix("MOSTLY_").removeprefix("GGML_TYPE_")
    if name in ("F32", "ALL_F32", "F16", "BF16", "F64"):
        return "none"
    if name.startswith(("Q6", "Q8")):
        return "int8"
    return "int4"


def bytes_per_param(scheme: str, dtype: str = "bfloat16", device_type: str = "cpu") -> float:
    """Average bytes per weight of a linear layer under `scheme` (codes plus scales).

    int4: half a byte + a (scale, zero) pair in `dtype` per INT4_GROUP weights;
    int8: one byte, on every device (its per-output-channel scale is negligible);
    none: the dtype's size. `device_type` is kept for callers that size per device.
    """
    size = DTYPE_BYTES.get(dtype, 2)
    if scheme == "int4":
        return 0.5 + 2 * size / INT4_GROUP
    if scheme == "int8":
        return 1.0
    return float(size)


def quantized_gb(
    params_b: float, embed_b: float, scheme: str, dtype: str = "bfloat16", embed_bytes: float | None = None
) -> float:
    """Weight memory in GB of a model of `params_b` billion parameters, `embed_b` of them in
    the token embedding, which takes `embed_bytes` per weight (None: the dtype's size; a
    GGUF's embedding stays quantized) while a quantized copy of it serves as lm_head.

    Counts every parameter at the quantized rate plus the embedding: exact for tied
    embeddings, a little high (by the lm_head's codes) for untied ones.
    """
    size = DTYPE_BYTES.get(dtype, 2)
    if scheme == "none":
        return params_b * size
    return params_b * bytes_per_param(scheme, dtype) + embed_b * (size if embed_bytes is None else embed_bytes)
