"""GGUF -> cached int8 / int4 checkpoint, one tensor (and one block of rows) at a time.

Nothing ever holds a full-precision copy of the model: each GGUF tensor is read a block
of rows at a time, turned into the quantized layout (Q4_0/Q4_1/Q4_K change layout
exactly, other types are de-quantized and re-quantized) and streamed to disk. The token
embedding, quantized in the file already, stays quantized too (_embedding_scheme). The cache
directory holds config + tokenizer (from the GGUF metadata, via gguf_convert), one
model.safetensors of codes, scales and the float tensors, and quantization.json; it is
keyed by the file's sha256 + scheme + dtype, built under a temporary name and renamed,
with the marker written last; the metadata (config, tokenizer) is read by a child process
while the tensors convert, and progress counts the GGUF's bytes. Tensor names on both sides, which linears are quantized and
llama.cpp's q/k row order come from the architecture's description (arch.py). Knows
nothing about where GGUF files come from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ssdlocal.backends.torch.arch import Architecture, for_gguf
from ssdlocal.backends.torch.gguf_read import (
    EXACT_INT4,
    GGUFHeader,
    TensorInfo,
    dequantize_rows,
    int4_rows,
)
from ssdlocal.backends.torch.quant import (
    QuantizedWeight,
    can_quantize,
    pack_int4,
    quantize,
)
from ssdlocal.backends.torch.stfile import MemoryReleaser, SafetensorsWriter
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.files import file_lock, record_digests
from ssdlocal.core.paths import ProgressCallback, cache_dir
from ssdlocal.core.progress import model_label, reporter
from ssdlocal.core.quantization import scheme_for_gguf_type

log = logging.getLogger(__name__)

QUANT_FILE = "quantization.json"  # in a quantized checkpoint: scheme, group size, dtype, source
_MARKER = "ssdlocal-quantize.json"
_META_MARKER = "ssdlocal-meta.json"
_FORMAT = 2  # in the cache key: a new layout never reads an old cache
_ROWS_ELEMENTS = 1 << 20  # weights per block of rows read from the GGUF


# --------------------------------------------------------------------------- keys and schemes


def content_key(gguf_path: Path) -> str:
    """sha256 of the file, computed once per (path, size, mtime, inode) and remembered.

    A download verified by ssdlocal.weights.assets already records it next to the file.
    """
    st = gguf_path.stat()
    verified = gguf_path.with_name(gguf_path.name + ".verified.json")
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(verified.read_text())
        if info.get("size") == st.st_size and isinstance(info.get("sha256"), str):
            return info["sha256"]
    stat_key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = cache_dir() / "gguf-keys" / (hashlib.sha256(stat_key.encode()).hexdigest()[:32] + ".txt")
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    digest = hashlib.sha256()
    progress, done = reporter(), 0
    stage = f"checking {model_label(gguf_path)} (sha256)"
    with open(gguf_path, "rb") as fh:
        while block := fh.read(16 << 20):
            digest.update(block)
            done += len(block)
            if progress:
                progress(stage, done, st.st_size)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
    tmp.write_text(digest.hexdigest() + "\n")
    os.replace(tmp, memo)
    return digest.hexdigest()


def gguf_scheme(gguf_path: Path, header: GGUFHeader | None = None) -> str:
    """What `--quantization auto` means for this file: its file type's class
    (Q4_* / Q5_* -> int4, Q8_0 / Q6_K -> int8, floats -> none)."""
    header = header or GGUFHeader.read(gguf_path)
    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int):
        from gguf import LlamaFileType

        with contextlib.suppress(ValueError):
            return scheme_for_gguf_type(LlamaFileType(file_type).name)
    sizes: dict[str, int] = {}  # no file type: the type holding most matrix weights
    for t in header.tensors:
        if len(t.shape) == 2:
            sizes[t.type_name] = sizes.get(t.type_name, 0) + t.shape[0] * t.shape[1]
    return scheme_for_gguf_type(max(sizes, key=sizes.get)) if sizes else "none"


def is_quantized_cache(path: Path) -> bool:
    """Whether `path` is a quantized checkpoint this module wrote (a cache entry)."""
    return (Path(path) / _MARKER).is_file()


def quantized_dir(gguf_path: Path, scheme: str, dtype: str) -> Path:
    stem = gguf_path.name.removesuffix(".gguf")
    return cache_dir() / "quantized" / f"{stem}-{scheme}-{dtype}-v{_FORMAT}-{content_key(gguf_path)[:16]}"


def _build_atomically(out: Path, marker: str, build) -> Path:
    """Run build(tmp) into a temporary sibling of `out`, write nothing half-done, rename."""
    if (out / marker).is_file():
        return out
    with file_lock(out.with_name(out.name + ".lock")):  # one converter per file; others wait
        if (out / marker).is_file():
            return out
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            build(tmp)
            shutil.rmtree(out, ignore_errors=True)  # a stale directory without its marker
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- metadata


def metadata_dir(gguf_path: Path) -> Path:
    """A cached directory with only config.json, generation_config.json and the tokenizer
    of a GGUF file: what needs no weights (tokenizer checks, config, planning) reads it.

    transformers builds both from the GGUF metadata, parsing the file with a reader that
    touches every page of it (20-40 s and the file's size in resident memory for the offline
    1.5B on 2 cores), so that runs once, in a child process: the caller's memory stays that
    of its model (and a quantization runs meanwhile: ensure_quantized).
    """
    gguf_path = Path(gguf_path)
    stem = gguf_path.name.removesuffix(".gguf")
    out = cache_dir() / "gguf-meta" / f"{stem}-{content_key(gguf_path)[:16]}"
    if (out / _META_MARKER).is_file():
        return out
    header = GGUFHeader.read(gguf_path)
    arch = for_gguf(header.metadata.get("general.architecture"), gguf_path.name)
    tied = arch.gguf.theirs("lm_head.weight") not in {t.name for t in header.tensors}
    chat = "tokenizer.chat_template" in header.metadata

    def build(tmp: Path) -> None:
        progress = reporter()
        stage = f"reading tokenizer: {model_label(gguf_path)}"
        if progress:
            progress(stage, 0, 1)
        _run_metadata_child(gguf_path, tmp, arch, tied, chat)
        if progress:
            progress(stage, 1, 1)

    return _build_atomically(out, _META_MARKER, build)


def _run_metadata_child(gguf_path: Path, tmp: Path, arch, tied: bool, chat: bool) -> None:
    """Write the metadata directory's files into `tmp` from a child process."""
    import subprocess
    import sys

    import ssdlocal

    env = dict(os.environ)  # the child imports this very package, wherever it lives
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(ssdlocal.__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p
    )
    args = [str(gguf_path), str(tmp), arch.hf_architectures[0], str(int(tied)), str(int(chat))]
    run = subprocess.run([sys.executable, "-c", _METADATA_CHILD, *args], env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    error = tmp / "error.json"
    if error.is_file():
        raise ModelLoadError(**json.loads(error.read_text()))
    if run.returncode != 0 or not (tmp / "config.json").is_file():
        tail = (run.stderr or "").strip().splitlines()[-3:]
        raise ModelLoadError(f"reading the metadata of {gguf_path.name} failed: {' / '.join(tail)}",
                             "run again; if it persists the file may be damaged: fetch it again")
    (tmp / _META_MARKER).write_text(json.dumps({"source": gguf_path.name}) + "\n")


_METADATA_CHILD = (
    "import sys; from ssdlocal.backends.torch.gguf_quant import _write_metadata; "
    "_write_metadata(*sys.argv[1:4], sys.argv[4] == '1', sys.argv[5] == '1')"
)


def _write_metadata(gguf_path: str, out: str, architecture: str, tied: bool, chat: bool) -> None:
    """Child process: transformers' config + tokenizer of the GGUF, saved into `out`."""
    from ssdlocal.backends.torch import gguf_convert as conv
    from ssdlocal.core.errors import SSDLocalError

    _parse_metadata_once()
    try:
        config, tokenizer = conv.read_config_and_tokenizer(Path(gguf_path))
        # tied iff the file has no separate output matrix (llama.cpp then reuses the embedding)
        config.tie_word_embeddings = tied
        conv.write_config_and_tokenizer(Path(out), config, tokenizer, architecture, torch.bfloat16)
        conv.check_chat_template(Path(out), {"has_chat_template": chat})
    except SSDLocalError as exc:
        (Path(out) / "error.json").write_text(json.dumps({"message": exc.message, "hint": exc.hint}))


def _parse_metadata_once() -> None:
    """transformers parses the whole GGUF (every vocabulary string through numpy views,
    ~20 s for the offline 1.5B on 2 cores) once for the config and again for the tokenizer;
    in the metadata child the second asks for what the first already read."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint

    @functools.lru_cache(maxsize=2)
    def metadata_only(path: str):
        return original(path, return_tensors=False)

    def load(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(path, return_tensors, *args, **kwargs)
        return metadata_only(str(path))

    gguf_utils.load_gguf_checkpoint = load


# --------------------------------------------------------------------------- conversion


def ensure_quantized(gguf_path: Path, scheme: str, dtype: str = "bfloat16",
                     progress: ProgressCallback | None = None) -> Path:  # fmt: skip
    """The cached `scheme` (int8 | int4) checkpoint of `gguf_path`, converting on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}", "check the path")
    out = quantized_dir(gguf_path, scheme, dtype)
    if (out / _MARKER).is_file():
        return out
    progress = reporter(progress)

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        with _in_background(metadata_dir, gguf_path) as meta_result:  # a child process: no GIL
            header = GGUFHeader.read(gguf_path)
            heads, tied = _heads_and_tying(header)
            info_tensors = _convert(gguf_path, tmp / "model.safetensors", scheme, getattr(torch, dtype),
                                    heads, tied, progress)  # fmt: skip
        meta = meta_result()
        for f in meta.iterdir():
            if f.is_file() and f.name != _META_MARKER:
                shutil.copy(f, tmp / f.name)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        info = {"format": _FORMAT, "scheme": scheme, "group_size": 32 if scheme == "int4" else 0,
                "dtype": dtype, "source": gguf_path.name, "path": str(gguf_path.resolve()),
                "sha256": content_key(gguf_path)}  # fmt: skip
        info["tensors"] = info_tensors
        (tmp / QUANT_FILE).write_text(json.dumps(info, indent=1) + "\n")
        record_digests(tmp)  # checked before every load (loader.resolve_checkpoint)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / _MARKER).write_text(json.dumps(info, indent=1) + "\n")  # last: the directory is whole
        log.info("quantized %s to %s (%s) in %.1fs", gguf_path.name, scheme, dtype, info["seconds"])

    return _build_atomically(out, _MARKER, build)


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


def _convert(gguf_path: Path, out: Path, scheme: str, dtype: torch.dtype, heads: tuple[int, int],
             tied: bool, progress: ProgressCallback | None) -> dict[str, int]:  # fmt: skip
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
                _add_quantized(writer, gguf_path, info, arch, module, _embedding_scheme(info, scheme),
                               dtype, None, counts)  # fmt: skip
            else:
                writer.add(arch.to_checkpoint(name), _float_tensor(gguf_path, info, dtype, rows))
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
    """A GGUF's embedding stays quantized: int4 where its values are int4 already (Q4_*,
    exact), int8 per row otherwise (finer than the 5- and 6-bit types it comes from)."""
    exact = scheme == "int4" and info.ggml_type in EXACT_INT4 and can_quantize(info.shape, "int4")
    return "int4" if exact else "int8"


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


def _add_quantized(writer, path: Path, info: TensorInfo, arch: Architecture, module: str, scheme: str,
                   dtype: torch.dtype, rows, counts: dict[str, int]) -> None:  # fmt: skip
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
    return QuantizedWeight(first.scheme, torch.cat([p.codes for p in parts]),
                           torch.cat([p.scales for p in parts]), zeros, first.group_size)  # fmt: skip
