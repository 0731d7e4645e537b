"""GGUF -> cached int8 / int4 checkpoint, one tensor (and one block of rows) at a time.

Nothing ever holds a full-precision copy of the model: each GGUF tensor is read a block
of rows at a time, turned into the quantized layout (Q4_0/Q4_1/Q4_K change layout
exactly, other types are de-quantized and re-quantized) and streamed to disk. The token
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

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ssdlocal.backends.torch.quant import (
    QuantizedWeight,
    pack_int4,
    quantize,
)
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.quantization import can_quantize, gguf_embedding_scheme
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
from ssdlocal.weights.formats.metadata import (
    META_MARKER,
    build_atomically,
    content_key,
    metadata_dir,
)
from ssdlocal.weights.formats.quantized import QUANT_FILE, QUANTIZED_MARKER
from ssdlocal.weights.formats.safetensors import MemoryReleaser, SafetensorsWriter

log = logging.getLogger(__name__)

_FORMAT = 2  # in the cache key: a new layout never reads an old cache
_ROWS_ELEMENTS = 1 << 20  # weights per block of rows read from the GGUF


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
        with _in_background(metadata_dir, gguf_path) as meta_result:  # a child process: no GIL
            header = GGUFHeader.read(gguf_path)
            heads, tied = _heads_and_tying(header)
            info_tensors = _convert(
                gguf_path, tmp / "model.safetensors", scheme, getattr(torch, dtype), heads, tied, progress
            )
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
            "group_size": 32 if scheme == "int4" else 0,
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


@contextlib.contextmanager
def _in_background(fn, *args):
    """Run fn(*args) in a thread while the block runs; yields a function returning its
    result (re-raising its error) once the block is done."""
    import threading

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="ssdlocal-gguf-metadata", daemon=True)
    thread.start()
    try:
        yield lambda: box["value"]
    finally:
        thread.join()  # (a failure in the block wins over the thread's)
    if "error" in box:
        raise box["error"]


def _heads_and_tying(header: GGUFHeader) -> tuple[tuple[int, int], bool]:
    """((attention heads, kv heads), tied embedding) from a GGUF header: the same facts the
    metadata's config.json records (tied: the file has no separate output matrix)."""
    file_arch = header.metadata.get("general.architecture")
    arch = for_gguf(file_arch, header.path.name)
    n_heads = int(header.metadata[f"{file_arch}.attention.head_count"])
    kv = header.metadata.get(f"{file_arch}.attention.head_count_kv")
    tied = arch.gguf.theirs("lm_head.weight") not in {t.name for t in header.tensors}
    return (n_heads, int(kv) if kv else n_heads), tied


def _convert(
    gguf_path: Path,
    out: Path,
    scheme: str,
    dtype: torch.dtype,
    heads: tuple[int, int],
    tied: bool,
    progress: ProgressCallback | None,
) -> dict[str, int]:
    """Stream every tensor into `out`; returns how many tensors went to each storage kind.
    Progress counts the GGUF's tensor bytes read."""
    header = GGUFHeader.read(gguf_path)
    arch = for_gguf(header.metadata.get("general.architecture"), gguf_path.name)
    writer = SafetensorsWriter(out)
    counts = {"quantized": 0, "float": 0, "exact_int4": 0}
    releaser = MemoryReleaser()
    stage = f"quantizing {model_label(gguf_path)} to {scheme}"
    sizes = [t.shape[0] * t.row_bytes() if len(t.shape) > 1 else t.row_bytes() for t in header.tensors]
    total, done = sum(sizes), 0
    if progress:
        progress(stage, 0, total)
    try:
        for i, info in enumerate(header.tensors):
            name = arch.from_gguf(info.name)
            if name is None:
                continue
            module, _, leaf = name.rpartition(".")
            rows = _row_order(module, info.shape[0], heads) if arch.gguf_qk_interleaved else None
            # tied: lm_head gets codes of its own, else it must share a float embedding
            head_from_embedding = arch.quantized("lm_head") and can_quantize(info.shape, scheme)
            if leaf == "weight" and arch.quantized(module) and can_quantize(info.shape, scheme):
                _add_quantized(writer, gguf_path, info, arch, module, scheme, dtype, rows, counts)
            elif name == "embed_tokens.weight" and (not tied or head_from_embedding):
                _add_quantized(
                    writer, gguf_path, info, arch, module, _embedding_scheme(info, scheme), dtype, None, counts
                )
            else:
                tensor = _float_tensor(gguf_path, info, dtype, rows)
                if arch.gguf_norm_shift and leaf == "weight" and module.endswith("norm"):
                    tensor = tensor - arch.gguf_norm_shift  # llama.cpp stored Gemma's (1 + weight)
                writer.add(arch.to_checkpoint(name), tensor)
                counts["float"] += 1
            if name == "embed_tokens.weight" and tied and head_from_embedding:
                _add_quantized(writer, gguf_path, info, arch, "lm_head", scheme, dtype, None, counts)
            releaser.processed(info.shape[0] * info.row_bytes())
            done += sizes[i]
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


def _row_order(module: str, n_rows: int, heads: tuple[int, int]) -> torch.Tensor | None:
    """For an architecture whose q/k rows llama.cpp stores per head as (pairs, 2) instead
    of (2, half) (Architecture.gguf_qk_interleaved): the index that restores the Hugging
    Face order, or None for other tensors."""
    n_heads = heads[0] if module.endswith("q_proj") else heads[1] if module.endswith("k_proj") else 0
    if not n_heads:
        return None
    index = torch.arange(n_rows).view(n_heads, n_rows // n_heads // 2, 2)
    return index.transpose(1, 2).reshape(-1)


def _row_blocks(info: TensorInfo) -> Iterator[tuple[int, int]]:
    n = info.shape[0] if len(info.shape) > 1 else 1
    step = max(32, _ROWS_ELEMENTS // info.shape[-1] // 32 * 32)
    for start in range(0, n, step):
        yield start, min(n, start + step)


def _float_tensor(path: Path, info: TensorInfo, dtype: torch.dtype, rows) -> torch.Tensor:
    """A tensor kept in floating point (embedding, norms, biases), filled block by block."""
    if len(info.shape) == 1:
        out = torch.from_numpy(dequantize_rows(path, info, 0, 1)[0].copy()).to(dtype)
    else:
        out = torch.empty(info.shape, dtype=dtype)
        for start, stop in _row_blocks(info):
            out[start:stop] = torch.from_numpy(dequantize_rows(path, info, start, stop))
    return out if rows is None else out[rows]


def _add_quantized(
    writer,
    path: Path,
    info: TensorInfo,
    arch: Architecture,
    module: str,
    scheme: str,
    dtype: torch.dtype,
    rows,
    counts: dict[str, int],
) -> None:
    parts = []
    exact = scheme == "int4" and info.ggml_type in EXACT_INT4
    for start, stop in _row_blocks(info):
        if exact:
            q, s, z = (torch.from_numpy(a) for a in int4_rows(path, info, start, stop))
            parts.append(pack_int4(q, s, z, dtype))
        else:
            parts.append(quantize(torch.from_numpy(dequantize_rows(path, info, start, stop)), scheme, dtype))
    qw = _concat(parts)
    if rows is not None:
        qw = qw.permute_rows(rows)
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
