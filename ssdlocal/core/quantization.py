"""Weight quantization and activation dtype names and sizes, free of torch: what
`--quantization` and `--dtype` accept (the `Quantization` and `DType` choices), which
scheme a GGUF type name maps to, and how many bytes a parameter takes under each scheme.

The quantized kernels and the quantizer live in the torch backend, what a quantized
checkpoint is as files in ssdlocal.weights.formats; this module only knows names and
arithmetic.
"""

from __future__ import annotations

from ssdlocal.core.choice import Choice


class Quantization(Choice):
    """The weights of a model (`--quantization`): float (NONE), int8 or int4 codes with
    scales, or AUTO (a GGUF's own class, a quantized checkpoint's scheme; floats else).
    A scheme is what AUTO resolves to: NONE, INT8 or INT4 (SCHEMES)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    AUTO = "auto"

    @property
    def quantized(self) -> bool:
        """Codes with scales (int8, int4): applied by the torch backend only."""
        return self in _QUANTIZED


class DType(Choice):
    """The activation dtype a model runs in (`--dtype`)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def bytes(self) -> int:
        """Bytes per value."""
        return 4 if self is DType.FLOAT32 else 2


_QUANTIZED = frozenset({Quantization.INT8, Quantization.INT4})
QUANTIZATIONS = Quantization.choices()  # what --quantization accepts
SCHEMES = (Quantization.NONE, Quantization.INT8, Quantization.INT4)  # what `auto` resolves to
INT4_GROUP = 32  # int4 weights carry one (scale, zero) pair per 32 input features
DTYPE_BYTES = {dtype: dtype.bytes for dtype in DType}  # bytes per value of each activation dtype
DEFAULT_DTYPE = DType.BFLOAT16  # the activation dtype models run in unless told otherwise


def can_quantize(shape: tuple[int, ...], scheme: Quantization) -> bool:
    """Whether a weight of `shape` (a matrix, or a stack of expert matrices: the last two
    dims) takes `scheme`: int4 needs whole groups along the input features; int8 any matrix."""
    if len(shape) not in (2, 3):
        return False
    return scheme == Quantization.INT8 or (scheme == Quantization.INT4 and shape[-1] % INT4_GROUP == 0)


def gguf_embedding_scheme(exact_int4: bool, shape: tuple[int, ...], scheme: Quantization) -> Quantization:
    """How the torch backend keeps a GGUF's token embedding, quantized in the file already:
    int4 where its values are int4 already (Q4_0/Q4_1/Q4_K, `exact_int4`: exact) and the
    scheme is int4, int8 rows otherwise (finer than the 5- and 6-bit types it comes from)."""
    int4 = scheme == Quantization.INT4 and exact_int4 and can_quantize(shape, Quantization.INT4)
    return Quantization.INT4 if int4 else Quantization.INT8


def scheme_for_gguf_type(type_name: str) -> Quantization:
    """The scheme `auto` picks for a GGUF file or tensor type name (e.g. "Q4_K_M", "MOSTLY_Q8_0").

    4- and 5-bit types (and anything coarser) -> int4; Q6_K / Q8_* -> int8; floats -> none.
    """
    name = type_name.upper().removeprefix("MOSTLY_").removeprefix("GGML_TYPE_")
    if name in ("F32", "ALL_F32", "F16", "BF16", "F64"):
        return Quantization.NONE
    if name.startswith(("Q6", "Q8")):
        return Quantization.INT8
    return Quantization.INT4


def bytes_per_param(scheme: Quantization, dtype: DType = DEFAULT_DTYPE, device_type: str = "cpu") -> float:
    """Average bytes per weight of a linear layer under `scheme` (codes plus scales).

    int4: half a byte + a (scale, zero) pair in `dtype` per INT4_GROUP weights;
    int8: one byte, on every device (its per-output-channel scale is negligible);
    none: the dtype's size. `device_type` is kept for callers that size per device.
    """
    size = DTYPE_BYTES.get(dtype, 2)
    if scheme == Quantization.INT4:
        return 0.5 + 2 * size / INT4_GROUP
    if scheme == Quantization.INT8:
        return 1.0
    return float(size)


def quantized_gb(
    params_b: float,
    embed_b: float,
    scheme: Quantization,
    dtype: DType = DEFAULT_DTYPE,
    embed_bytes: float | None = None,
) -> float:
    """Weight memory in GB of a model of `params_b` billion parameters, `embed_b` of them in
    the token embedding, which takes `embed_bytes` per weight (None: the dtype's size; a
    GGUF's embedding stays quantized) while a quantized copy of it serves as lm_head.

    Counts every parameter at the quantized rate plus the embedding: exact for tied
    embeddings, a little high (by the lm_head's codes) for untied ones.
    """
    size = DTYPE_BYTES.get(dtype, 2)
    if scheme == Quantization.NONE:
        return params_b * size
    return params_b * bytes_per_param(scheme, dtype) + embed_b * (size if embed_bytes is None else embed_bytes)
