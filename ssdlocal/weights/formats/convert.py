"""Convert a GGUF file of any architecture in the table (weights/formats/archs.py) once
into a cached float checkpoint in Hugging Face layout.

Every tensor is de-quantized (any ggml type the `gguf` package decodes) a block of rows at
a time and streamed into model.safetensors under the names a published checkpoint of that
architecture uses (weights/formats/gguf_tensors.py walks the file: llama.cpp's q/k row
order undone, stacked experts written one by one); config.json, generation_config.json and
the tokenizer come from the file's metadata directory (metadata.py), read meanwhile in a
child process. The native torch loader then reads it in seconds. The cache key is the GGUF file's content (sha256) plus the dtype; one process converts
a file at a time (a lock), leftovers of killed conversions are removed, and a directory
is trusted only once its marker is written. Knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from math import prod
from pathlib import Path

from ssdlocal.core.errors import AssetError, ModelLoadError
from ssdlocal.core.files import file_lock, record_digests, remembered_sha256
from ssdlocal.core.memory import human_bytes
from ssdlocal.core.paths import ProgressCallback, cache_dir, replace_hint
from ssdlocal.core.progress import model_label, reporter
from ssdlocal.core.quantization import DType
from ssdlocal.weights.formats.archs import find, for_gguf, unsupported
from ssdlocal.weights.formats.hf_files import check_chat_template

log = logging.getLogger(__name__)

_SHORT = {DType.BFLOAT16: "bf16", DType.FLOAT16: "fp16", DType.FLOAT32: "fp32"}
CONVERTED_MARKER = "ssdlocal-convert.json"


def gguf_metadata(gguf_path: Path) -> dict[str, object]:
    """A few header fields of a GGUF file (architecture, name, chat template present, and
    the context length the model was trained for: llama.cpp's n_ctx_train; None if absent)."""
    try:  # transformers >= 5 has a header reader that skips big arrays (30 ms, not 6 s)
        from transformers.integrations.gguf.reader import read_gguf_metadata

        def read(path: str) -> dict[str, object]:
            return read_gguf_metadata(path, ())[0]
    except ImportError:
        read = _read_with_gguf
    try:
        fields = read(str(gguf_path))
    except ImportError as exc:
        raise ModelLoadError("reading GGUF files needs the `gguf` package", "pip install 'ssdlocal[torch]'") from exc
    except Exception as exc:  # readers raise ValueError/struct errors on junk files
        raise ModelLoadError(
            f"{gguf_path} is not a readable GGUF file: {str(exc)[:200]}",
            replace_hint(gguf_path),
        ) from exc
    arch = fields.get("general.architecture")
    context = fields.get(f"{arch}.context_length")
    return {
        "architecture": arch,
        "name": fields.get("general.name"),
        "has_chat_template": bool(fields.get("tokenizer.chat_template")),
        "context_length": context if isinstance(context, int) and context > 0 else None,
    }


def _read_with_gguf(path: str) -> dict[str, object]:
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    keys = ("general.architecture", "general.name", "tokenizer.chat_template", f"{arch}.context_length")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def is_conversion(path: Path) -> bool:
    """Whether `path` is a checkpoint directory this module wrote (a cache entry)."""
    return (Path(path) / CONVERTED_MARKER).is_file()


def converted_dir(gguf_path: Path, dtype: DType = DType.BFLOAT16, root: Path | None = None) -> Path:
    """The cache directory for `gguf_path` converted to `dtype` (may not exist yet): named
    by the file's content, so a changed file is converted again and a copy is not."""
    root = root or cache_dir() / "converted"
    key = remembered_sha256(gguf_path, root / "digests.json")
    stem = gguf_path.name.removesuffix(".gguf")
    return root / f"{stem}-{dtype}-{key[:16]}"


def ensure_converted(
    gguf_path: Path,
    progress: ProgressCallback | None = None,
    out_dir: Path | None = None,
    dtype: DType = DType.BFLOAT16,
) -> Path:
    """Return a checkpoint directory for `gguf_path`, converting it on first use.

    `out_dir` overrides the cache location. The directory appears atomically: it is
    written under a temporary name and renamed when complete.
    """
    gguf_path = Path(gguf_path)
    dtype = DType.parse(dtype, "dtype")
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}", "check the path")
    out = Path(out_dir) if out_dir is not None else converted_dir(gguf_path, dtype)
    if (out / CONVERTED_MARKER).is_file():
        return out

    meta = gguf_metadata(gguf_path)
    for_gguf(meta["architecture"], gguf_path.name)  # an architecture ssdlocal implements
    out.parent.mkdir(parents=True, exist_ok=True)
    # One converter per output: a second process waits here, then finds the marker.
    with file_lock(out.with_name(out.name + ".lock")):
        if (out / CONVERTED_MARKER).is_file():
            return out
        _remove_leftovers(out)
        _convert_into(gguf_path, out, dtype, meta, reporter(progress))
    return out


def _remove_leftovers(out: Path) -> None:
    """Under the lock nobody else converts into `out`: its temporary dirs are from killed
    processes, and `out` without a marker is half-written."""
    for stale in out.parent.glob(f"{out.name}.tmp-*"):
        log.info("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)


def _convert_into(gguf_path: Path, out: Path, dtype: DType, meta: dict, progress) -> None:
    """Convert into a temporary dir, write the marker last, then rename it to `out`."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        _convert(gguf_path, tmp, dtype, meta, progress)
        info = {
            "source": gguf_path.name,
            "sha256": out.name.rsplit("-", 1)[-1],
            "architecture": meta["architecture"],
            "dtype": dtype,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        record_digests(tmp)  # checked before every load (the torch loader's resolve_checkpoint)
        (tmp / CONVERTED_MARKER).write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, out)  # atomic: `out` does not exist (removed under the lock)
    except OSError as exc:
        raise _disk_error(exc, out) or exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1fs", gguf_path.name, out, time.perf_counter() - t0)


def _disk_error(exc: BaseException, where: Path, need: int | None = None) -> AssetError | None:
    """AssetError for a full disk (OSError ENOSPC, or safetensors' wrapped io error)."""
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        "No space left on device" in str(exc) or "StorageFull" in str(exc)
    )
    if not full:
        return None
    size = f" (~{human_bytes(need)} needed)" if need else ""
    return AssetError(
        f"no space left in {where.parent} for the converted checkpoint{size}",
        "free some disk space or point SSDLOCAL_CACHE at a larger disk, then rerun; nothing half-written was kept",
    )


def _convert(
    gguf_path: Path,
    tmp: Path,
    dtype: DType,
    meta: dict[str, object],
    progress: ProgressCallback | None,
) -> None:
    """Write `gguf_path` into `tmp` as a float checkpoint in `dtype`: every piece
    (weights/formats/gguf_tensors.py: our names as the checkpoint names them, q/k rows in
    Hugging Face order, stacked experts one by one) de-quantized a block of rows at a time
    and streamed to model.safetensors, with the file's metadata directory (config.json with
    the fields the description reads from the file, the tokenizer) read meanwhile."""
    try:
        import torch
    except ImportError as exc:
        raise ModelLoadError("converting GGUF files needs torch and gguf", "pip install 'ssdlocal[torch]'") from exc
    from ssdlocal.weights.formats.gguf import GGUFHeader
    from ssdlocal.weights.formats.gguf_tensors import pieces
    from ssdlocal.weights.formats.metadata import META_MARKER, in_background, metadata_dir
    from ssdlocal.weights.formats.safetensors import MemoryReleaser, SafetensorsWriter

    label, torch_dtype = model_label(gguf_path), getattr(torch, dtype)
    header = GGUFHeader.read(gguf_path)
    arch = for_gguf(header.metadata.get("general.architecture"), gguf_path.name)
    with in_background(metadata_dir, gguf_path) as meta_dir:  # a child process: no GIL
        found = list(pieces(header, arch))
        need = sum(prod(p.shape) for p in found) * torch_dtype.itemsize
        _check_free_space(tmp.parent, need)
        tmp.mkdir(parents=True)
        converting, writing = f"converting {label} to {_SHORT[dtype]}", f"writing {label} ({_SHORT[dtype]})"
        writer, releaser = SafetensorsWriter(tmp / "model.safetensors"), MemoryReleaser()
        try:
            for done, piece in enumerate(found):
                if progress:
                    progress(converting, done, len(found))  # tensors written
                writer.add(arch.to_checkpoint(piece.name), torch.from_numpy(piece.floats(gguf_path)).to(torch_dtype))
                releaser.processed(piece.file_bytes)
            if progress:
                progress(converting, len(found), len(found))
                progress(writing, 0, need)
            writer.close({"format": "pt"})
        except BaseException:
            writer.abort()
            raise
        if progress:
            progress(writing, need, need)
    for f in meta_dir().iterdir():
        if f.is_file() and f.name != META_MARKER:
            shutil.copy(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _check_saved(tmp, meta)


def _check_free_space(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need * 1.05 + (64 << 20):
        raise AssetError(
            f"not enough disk space in {where} for the converted checkpoint: "
            f"{human_bytes(free)} free, ~{human_bytes(need)} needed",
            "free some space or point SSDLOCAL_CACHE at a larger disk, then rerun",
        )


def _check_saved(tmp: Path, meta: dict[str, object]) -> None:
    """The saved checkpoint must hold the tensors and chat template we rely on."""
    from safetensors import safe_open

    config = json.loads((tmp / "config.json").read_text())
    weights = tmp / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"conversion wrote no {weights.name} in {tmp}", "report a bug")
    with safe_open(str(weights), "pt") as f:
        keys = set(f.keys())
    arch = find(config.get("architectures"), config.get("model_type"))
    if arch is None:
        raise unsupported(f"architecture {', '.join(config.get('architectures') or [])} (from {meta['name']})")
    needed = {arch.to_checkpoint("embed_tokens.weight"), arch.to_checkpoint("norm.weight")}
    if not config.get("tie_word_embeddings", False):
        needed.add(arch.to_checkpoint("lm_head.weight"))  # tied checkpoints store only the embedding
    missing = needed - keys
    if missing:
        raise ModelLoadError(f"converted checkpoint lacks tensors {sorted(missing)}", "report a bug")
    check_chat_template(tmp, meta)
