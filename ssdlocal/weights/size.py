"""How big a model is, from file headers only: one home for sizes below the backends.

What its weights take once loaded in a dtype under a quantization scheme (`weight_bytes`,
`checkpoint_gb`: quantized linears count codes and scales, a GGUF's embedding stays
quantized, a quantized checkpoint counts as stored), how many parameters it has and how
many one token reads (`parameters`: a mixture-of-experts model reads only its routed
experts), the bytes a forward step of N tokens reads (`step_bytes`: what speed estimates
divide by bandwidth), and its attention heads (`attention_heads`, what tensor parallelism divides).
What every tensor-parallel rank holds whole (`whole_bytes`) is the tensors the
architecture's table splits over no rank. Checkpoint directories (safetensors headers, config.json) and GGUF files (header and
metadata) are read here and nowhere else for sizes; the arithmetic per dtype and scheme
is core.quantization's, which tensors are quantized linears or experts the architecture
table's (weights/formats/arch.py). Placement (`devices`, `pairs`, auto placement), the
torch backend's preflight and the pair registry ask here. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

from ssdlocal.core.quantization import (
    DTYPE_BYTES,
    DType,
    Quantization,
    bytes_per_param,
    can_quantize,
    gguf_embedding_scheme,
)
from ssdlocal.core.reads import experts_touched
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import find, for_gguf, unsupported
from ssdlocal.weights.formats.checks import read_config_json, text_part
from ssdlocal.weights.formats.checkpoint import config_dir, damaged_hint
from ssdlocal.weights.formats.gguf import EXACT_INT4, GGUFHeader
from ssdlocal.weights.formats.quantized import quant_info, resolve_scheme
from ssdlocal.weights.formats.safetensors import SafetensorsReader


@dataclass(frozen=True)
class Shapes:
    """A model's tensors as our names (arch.py) -> shapes, read from headers.

    `exact_int4_embedding`: a GGUF whose embedding holds int4 values already (Q4_0/Q4_1/
    Q4_K: the torch backend keeps it int4); None for a safetensors checkpoint (floats).
    `experts`: (routed experts, experts each token reads) when the model has experts."""

    arch: Architecture
    tensors: dict[str, tuple[int, ...]]
    exact_int4_embedding: bool | None = None
    experts: tuple[int, int] | None = None


def read_shapes(path: str | Path) -> Shapes:
    """The tensors of a float checkpoint directory or a .gguf file (headers only); a
    multimodal checkpoint's text model only (arch.Multimodal: its towers are never loaded)."""
    path = Path(path).expanduser()
    if path.is_file():
        header = GGUFHeader.read(path)
        arch = for_gguf(header.metadata.get("general.architecture"), path.name)
        tensors, exact = {}, None
        for t in header.tensors:
            name = arch.from_gguf(t.name)
            if name is not None:
                tensors[name] = t.shape
            if name == "embed_tokens.weight":
                exact = t.ggml_type in EXACT_INT4
        prefix = f"{arch.gguf_architecture}."
        counts = (header.metadata.get(prefix + "expert_count"), header.metadata.get(prefix + "expert_used_count"))
        return Shapes(arch, tensors, exact, _experts(*counts))
    raw = _config(path)
    described = find(raw.get("architectures"), raw.get("model_type"))
    if described is None:
        raise unsupported(f"architecture {', '.join(raw.get('architectures') or []) or 'unknown'}")
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with SafetensorsReader(file) as f:
            for name in f.keys():  # noqa: SIM118 - a reader, not a dict
                tensors.update(described.checkpoint_shapes(name, f.shape(name)))  # packed ones as ours
    return Shapes(described, tensors, None, _experts(*described.expert_counts(text_part(raw))))


def _experts(routed: object, used: object) -> tuple[int, int] | None:
    if isinstance(routed, int) and isinstance(used, int) and routed > 0 and 0 < used <= routed:
        return routed, used
    return None


def _config(path: Path) -> dict:
    """config.json of a checkpoint directory (or of a GGUF's metadata directory); {} without one."""
    file = path / "config.json"
    return read_config_json(file, damaged_hint(path)) if file.is_file() else {}


def weight_bytes(path: str | Path, scheme: Quantization, dtype: DType, device_type: str = "cpu") -> int:
    """Bytes the weights of `path` (checkpoint directory, quantized checkpoint or .gguf) take
    once loaded with `scheme` (none | int8 | int4) in `dtype` on a `device_type` device:
    quantized linears (and experts) as codes and scales, a GGUF's embedding as the torch
    backend keeps it (quantized), a tied lm_head's own codes; a quantized checkpoint as stored."""
    path = Path(path).expanduser()
    if path.is_dir() and quant_info(path):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    shapes = read_shapes(path)
    return int(sum(_tensor_bytes(shapes, scheme, dtype, device_type).values()))


def whole_bytes(path: str | Path, scheme: Quantization, dtype: DType, device_type: str = "cpu") -> int:
    """Of `weight_bytes`, the bytes every tensor-parallel rank holds whole: the tensors the
    architecture's table splits over no rank (`Architecture.split_dim` None: embeddings,
    norms, lm_head, a row split's bias, and linears it keeps replicated, such as Qwen3.5's
    linear-attention layers); a rank of N holds these plus 1/N of the rest. Rank 0 holds
    the lm_head (the others drop it), so this is the largest rank's share. 0 for a quantized
    checkpoint (sized as stored)."""
    path = Path(path).expanduser()
    if path.is_dir() and quant_info(path):
        return 0
    shapes = read_shapes(path)
    sizes = _tensor_bytes(shapes, scheme, dtype, device_type)
    return int(sum(size for name, size in sizes.items() if shapes.arch.split_dim(name) is None))


def step_bytes(path: str | Path, scheme: Quantization, dtype: DType, tokens: int = 1, device_type: str = "cpu") -> int:
    """Weight bytes one forward step of `tokens` tokens reads from `path`'s weights as loaded
    with `scheme` in `dtype` (weight_bytes's sizes): every weight but the embedding table
    (a step gathers its rows; a tied one is read whole as the head), and of the routed
    experts the share a step of `tokens` tokens is expected to touch (core.reads). What the
    speed estimates divide by bandwidth (`bench --project`, scripts/gpu_accept.py)."""
    shapes = read_shapes(path)
    touched = experts_touched(*shapes.experts, tokens) if shapes.experts else 1.0
    sizes = _tensor_bytes(shapes, scheme, dtype, device_type)
    total = 0.0
    for name, size in sizes.items():
        if name == "embed_tokens.weight" and "lm_head.weight" in sizes:
            continue  # rows only (the head is a matrix of its own, or codes of its own)
        total += size * touched if shapes.arch.is_expert(name.rpartition(".")[0]) else size
    return int(total)


def _tensor_bytes(shapes: Shapes, scheme: Quantization, dtype: DType, device_type: str) -> dict[str, float]:
    """Our tensor name -> bytes it takes loaded with `scheme` in `dtype` (a tied lm_head's
    own codes under "lm_head.weight")."""
    size = DTYPE_BYTES.get(dtype, 2)
    quantized = bytes_per_param(scheme, dtype, device_type)
    out: dict[str, float] = {}
    for name, shape in shapes.tensors.items():
        module, _, leaf = name.rpartition(".")
        n = prod(shape)
        if name == "embed_tokens.weight":
            embedding = float(size)
            if shapes.exact_int4_embedding is not None:  # a GGUF's embedding stays quantized
                embedding = bytes_per_param(gguf_embedding_scheme(shapes.exact_int4_embedding, shape, scheme), dtype)
            out[name] = n * embedding
            if "lm_head.weight" not in shapes.tensors and can_quantize(shape, scheme):
                out["lm_head.weight"] = n * quantized  # a tied lm_head gets codes of its own
        elif leaf == "weight" and shapes.arch.quantized(module) and can_quantize(shape[-2:], scheme):
            out[name] = n * quantized
        else:
            out[name] = n * size
    return out


def checkpoint_gb(
    path: str | Path, dtype: DType, quantization: Quantization = Quantization.NONE, device_type: str = "cpu"
) -> float:
    """Weights of `path` in GB when loaded as `dtype` with `quantization` (none | int8 | int4 |
    auto, resolved for the path) on a `device_type` device; a .gguf loaded as floats counts
    by its size on disk (the torch backend dequantizes it; llama.cpp runs it as it is)."""
    path = Path(path).expanduser()
    scheme = _scheme(path, quantization)
    if scheme is not Quantization.NONE:
        return weight_bytes(path, scheme, dtype, device_type) / 1e9
    if path.is_file():
        return path.stat().st_size / 1e9
    return weight_bytes(path, Quantization.NONE, dtype, device_type) / 1e9


def whole_gb(
    path: str | Path, dtype: DType, quantization: Quantization = Quantization.NONE, device_type: str = "cpu"
) -> float:
    """Of checkpoint_gb's weights, the GB every tensor-parallel rank holds whole (whole_bytes)."""
    path = Path(path).expanduser()
    return whole_bytes(path, _scheme(path, quantization), dtype, device_type) / 1e9


def _scheme(path: Path, quantization: Quantization) -> Quantization:
    """`quantization` as loading `path` applies it (auto resolved for the path)."""
    return Quantization.NONE if quantization == Quantization.NONE else resolve_scheme(path, quantization)


@dataclass(frozen=True)
class Parameters:
    """Parameters of a model: `total`, and `active`, those one token reads (a routed
    expert's weights count only for the share of experts each token uses)."""

    total: int
    active: int


def parameters(path: str | Path) -> Parameters:
    """What `path`'s tensors hold, in all and per token (headers only)."""
    shapes = read_shapes(path)
    share = shapes.experts[1] / shapes.experts[0] if shapes.experts else 1.0
    total, active = 0, 0.0
    for name, shape in shapes.tensors.items():
        n = prod(shape)
        total += n
        module = name.rpartition(".")[0]
        active += n * share if shapes.arch.is_expert(module) else n
    return Parameters(total, int(active))


def attention_heads(path: str | Path) -> tuple[int, int]:
    """(attention heads, key/value heads) of the model at `path`, from its config (a .gguf
    file's metadata directory): what tensor parallelism divides."""
    raw = text_part(_config(config_dir(path)))  # a multimodal checkpoint's text model
    heads = raw.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        from ssdlocal.core.errors import ModelLoadError

        raise ModelLoadError(f"{path}: its config names no attention heads", damaged_hint(Path(path)))
    kv = raw.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) and kv > 0 else heads


def quantized_bytes(path: str | Path, quantization: Quantization, dtype: DType, device_type: str = "cpu") -> int | None:
    """Bytes of `path`'s weights loaded with `quantization` (int8 | int4 | auto), or None when
    they resolve to floats (nothing to quantize)."""
    scheme = resolve_scheme(path, quantization)
    return None if scheme is Quantization.NONE else weight_bytes(path, scheme, dtype, device_type)
