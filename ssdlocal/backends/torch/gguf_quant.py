"""GGUF -> cached int8 / int4 checkpoint, one tensor (and one block of rows) at a time.

Nothing ever holds a full-precision copy of the model: each GGUF tensor is read a block
of rows at a time, turned into the quantized layout (Q4_0/Q4_1/Q4_K change layout
exactly, other types are de-quantized and re-quantized) and streamed to disk. A stacked
experts tensor is quantized expert by expert, each as a Linear is, under the checkpoint's
per-expert names (weights/formats/gguf_tensors.py walks the file). The token
embedding, quantized in the file already, stays quantized too (_embedding_scheme). The cache
directory holds config + tokenizer (the GGUF's metadata directory: weights/formats/metadata.py),
one model.safetensors of codes, scales and the float tensors, and quantization.json
(weights/formats/quantized.py); it is keyed by the file's sha256 + scheme + dtype, built
under a temporary name and renamed, with the marker written last; the metadata is read by
a child process while the tensors convert, and progress counts the GGUF's bytes. Tensor
names on both sides, which linears are quantized and llama.cpp's q/k row order come from
the architecture's description (weights/formats/arch.py). Knows nothing about where GGUF
files come from.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from ssdlocal.backends.torch.quant import (
    QuantizedWeight,
    pack_int4,
    quantize,
)
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.quantization import Quantization, can_quantize, gguf_embedding_scheme
from ssdlocal.core.files import record_digests
from ssdlocal.core.paths import ProgressCallback, cache_dir
from ssdlocal.core.progress import model_label, reporter
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import for_gguf
from ssdlocal.weights.formats.gguf import (
    EXACT_INT4,
    GGUFHeader,
    TensorInfo,
    dequantize_rows,
    int4_rows,
)
from ssdlocal.weights.formats.gguf_tensors import Piece, pieces, tensor_rows
from ssdlocal.weights.formats.metadata import (
    META_MARKER,
    build_atomically,
    content_key,
    in_background,
    metadata_dir,
)
from ssdlocal.weights.formats.quantized import QUANT_FILE, QUANTIZED_MARKER
from ssdlocal.weights.formats.safetensors import MemoryReleaser, SafetensorsWriter

log = logging.getLogger(__name__)

_FORMAT = 2  # in the cache key: a new layout never reads an old cache


# --------------------------------------------------------------------------- the cache


def quantized_dir(gguf_path: Path, scheme: str, dtype: str) -> Path:
    """Where the `scheme` / `dtype` checkpoint of `gguf_path` is cached (may not exist yet)."""
    stem = gguf_path.name.removesuffix(".gguf")
    return cache_dir() / "quantized" / f"{stem}-{scheme}-{dtype}-v{_FORMAT}-{content_key(gguf_path)[:16]}"


# --------------------------------------------------------------------------- conversion


def ensure_quantized(
    gguf_path: Path, scheme: str, dtype: str = "bfloat16", progress: ProgressCallback | None = None
) -> Path:
    """The cached `scheme` (int8 | int4) checkpoint of `gguf_path`, converting on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}", "check the path")
    out = quantized_dir(gguf_path, scheme, dtype)
    if (out / QUANTIZED_MARKER).is_file():
        return out
    progress = reporter(progress)

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        with in_background(metadata_dir, gguf_path) as meta_result:  # a child process: no GIL
            info_tensors = _convert(gguf_path, tmp / "model.safetensors", scheme, getattr(torch, dtype), progress)
        meta = meta_result()
        for f in meta.iterdir():
            if f.is_file() and f.name != META_MARKER:
                shutil.copy(f, tmp / f.name)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        info = {
            "format": _FORMAT,
            "scheme": scheme,
            "group_size": 32 if scheme == Quantization.INT4 else 0,
            "dtype": dtype,
            "source": gguf_path.name,
            "path": str(gguf_path.resolve()),
            "sha256": content_key(gguf_path),
        }
        info["tensors"] = info_tensors
        (tmp / QUANT_FILE).write_text(json.dumps(info, indent=1) + "\n")
        record_digests(tmp)  # checked before every load (loader.resolve_checkpoint)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / QUANTIZED_MARKER).write_text(json.dumps(info, indent=1) + "\n")  # last: the directory is whole
        log.info("quantized %s to %s (%s) in %.1fs", gguf_path.name, scheme, dtype, info["seconds"])

    return build_atomically(out, QUANTIZED_MARKER, build)


def _convert(
    gguf_path: Path, out: Path, scheme: str, dtype: torch.dtype, progress: ProgressCallback | None
) -> dict[str, int]:
    """Stream every piece of the checkpoint (weights/formats/gguf_tensors.py: our names, q/k
    rows in Hugging Face order, stacked experts one by one) into `out`; returns how many
    tensors went to each storage kind. Progress counts the GGUF's tensor bytes read."""
    header = GGUFHeader.read(gguf_path)
    arch = for_gguf(header.metadata.get("general.architecture"), gguf_path.name)
    # tied: the file has no separate output matrix (the metadata's config.json says the same)
    tied = arch.gguf.theirs("lm_head.weight") not in {t.name for t in header.tensors}
    writer = SafetensorsWriter(out)
    counts = {"quantized": 0, "float": 0, "exact_int4": 0}
    releaser = MemoryReleaser()
    stage = f"quantizing {model_label(gguf_path)} to {scheme}"
    total, done = sum(tensor_rows(t) * t.row_bytes() for t in header.tensors), 0
    if progress:
        progress(stage, 0, total)
    try:
        for piece in pieces(header, arch):
            name, module, leaf = piece.name, piece.module, piece.leaf
            # tied: lm_head gets codes of its own, else it must share a float embedding
            head_from_embedding = arch.quantized("lm_head") and can_quantize(piece.shape, scheme)
            if leaf == "weight" and arch.quantized(module) and can_quantize(piece.shape, scheme):
                _add_quantized(writer, gguf_path, piece, arch, module, scheme, dtype, counts)
            elif name == "embed_tokens.weight" and (not tied or head_from_embedding):
                _add_quantized(
                    writer, gguf_path, piece, arch, module, _embedding_scheme(piece.info, scheme), dtype, counts
                )
            else:
                writer.add(arch.to_checkpoint(name), torch.from_numpy(piece.floats(gguf_path)).to(dtype))
                counts["float"] += 1
            if name == "embed_tokens.weight" and tied and head_from_embedding:
                _add_quantized(writer, gguf_path, piece, arch, "lm_head", scheme, dtype, counts)
            releaser.processed(piece.file_bytes)
            done += piece.file_bytes
            if progress:
                progress(stage, done, total)
    except BaseException:
        writer.abort()
        raise
    writer.close({"format": "pt"})
    releaser.flush()
    if progress:  # tensors the model does not use (none in supported files) were skipped
        progress(stage, total, total)
    return counts


def _embedding_scheme(info: TensorInfo, scheme: str) -> str:
    """A GGUF's embedding stays quantized (core.quantization.gguf_embedding_scheme)."""
    return gguf_embedding_scheme(info.ggml_type in EXACT_INT4, info.shape, scheme)


def _add_quantized(
    writer,
    path: Path,
    piece: Piece,
    arch: Architecture,
    module: str,
    scheme: str,
    dtype: torch.dtype,
    counts: dict[str, int],
) -> None:
    """`piece` as `module`'s codes and scales (a Linear's layout: one expert's matrix of a
    stacked tensor is quantized as a Linear is), a block of rows at a time."""
    parts = []
    info = piece.info
    exact = scheme == Quantization.INT4 and info.ggml_type in EXACT_INT4
    for start, stop in piece.row_blocks():
        if exact:
            q, s, z = (torch.from_numpy(a) for a in int4_rows(path, info, start, stop))
            parts.append(pack_int4(q, s, z, dtype))
        else:
            parts.append(quantize(torch.from_numpy(dequantize_rows(path, info, start, stop)), scheme, dtype))
    qw = _concat(parts)
    if piece.row_order is not None:
        qw = qw.permute_rows(torch.from_numpy(piece.row_order))
    for key, tensor in qw.tensors(arch.checkpoint.module(module)).items():
        writer.add(key, tensor)
    counts["exact_int4" if exact else "quantized"] += 1


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(
        first.scheme, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zeros, first.group_size
    )
