"""Convert a GGUF file (Llama / Qwen2 / Qwen3) once into a cached HF-format checkpoint.

transformers dequantizes the GGUF tensors to dense weights (slow: ~50 s for a 1.5B) and
names them as its own model class does (which GGUF architectures are accepted, and the
tensors the result must hold, come from the descriptions in arch.py);
we save the result as config.json + model.safetensors + tokenizer files +
generation_config.json so the native torch loader reads it in seconds afterwards.
The cache key is the GGUF file's content (sha256) plus the dtype; one process converts
a file at a time (a lock), leftovers of killed conversions are removed, and a directory
is trusted only once its marker is written. Knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from ssdlocal.core.errors import AssetError, ModelLoadError, UsageError
from ssdlocal.core.files import file_lock, record_digests, remembered_sha256
from ssdlocal.core.memory import human_bytes
from ssdlocal.core.paths import ProgressCallback, cache_dir, replace_hint
from ssdlocal.core.progress import model_label, reporter
from ssdlocal.weights.formats.archs import find, for_gguf, unsupported

log = logging.getLogger(__name__)

_DTYPES = ("bfloat16", "float16", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
CONVERTED_MARKER = "ssdlocal-convert.json"
# End-of-turn tokens that chat models emit; added to eos ids when present in the vocab.
EXTRA_EOS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


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
        "rope_scaling": fields.get(f"{arch}.rope.scaling.type"),
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


def converted_dir(gguf_path: Path, dtype: str = "bfloat16", root: Path | None = None) -> Path:
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
    dtype: str = "bfloat16",
) -> Path:
    """Return a checkpoint directory for `gguf_path`, converting it on first use.

    `out_dir` overrides the cache location. The directory appears atomically: it is
    written under a temporary name and renamed when complete.
    """
    gguf_path = Path(gguf_path)
    if dtype not in _DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r}", f"use one of {', '.join(_DTYPES)}")
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


def _convert_into(gguf_path: Path, out: Path, dtype: str, meta: dict, progress) -> None:
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


@contextlib.contextmanager
def _no_foreign_progress_bars(progress: ProgressCallback | None, stage: str) -> Iterator[None]:
    """Silence transformers' own tqdm bars ("Converting and de-quantizing GGUF tensors")
    while it reads a GGUF file; its tensor loop reports to `progress` as `stage` (tensors
    done, total) instead, so the caller's display is the only one."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:  # imported there from tqdm.auto, which ignores the switch above
        gguf_utils.tqdm = lambda iterable=(), *args, **kwargs: _reporting(iterable, progress, stage)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _reporting(iterable, progress: ProgressCallback | None, stage: str) -> Iterator:
    items = list(iterable)
    for i, item in enumerate(items):
        if progress:
            progress(stage, i, len(items))
        yield item
    if progress:
        progress(stage, len(items), len(items))


def _convert(
    gguf_path: Path,
    tmp: Path,
    dtype: str,
    meta: dict[str, object],
    progress: ProgressCallback | None,
) -> None:
    """Dequantize with transformers' GGUF reader and save the tensors directly.

    `from_pretrained(gguf_file=...)` would need `accelerate`; instead a meta-device
    model supplies the GGUF -> HF name map and the expected parameter names.
    """
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise ModelLoadError(
            "converting GGUF files needs torch, transformers, safetensors and gguf",
            "pip install 'ssdlocal[torch]'",
        ) from exc

    label = model_label(gguf_path)

    def step(stage: str, done: float, total: float | None) -> None:
        if progress:
            progress(stage, done, total)

    torch_dtype = getattr(torch, dtype)
    reading = f"reading tokenizer: {label}"
    step(reading, 0, 1)
    config, tokenizer = read_config_and_tokenizer(gguf_path)
    step(reading, 1, 1)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
        with _no_foreign_progress_bars(progress, f"converting {label} to {_SHORT[dtype]}"):
            parsed = load_gguf_checkpoint(
                str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch_dtype
            )
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise _unreadable(gguf_path, exc) from exc
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    _check_names(gguf_path, model, config, tensors)
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    _check_free_space(tmp.parent, need)
    tmp.mkdir(parents=True)
    writing = f"writing {label} ({_SHORT[dtype]})"
    step(writing, 0, need)
    # Tied checkpoints store only model.embed_tokens.weight (like HF's own Qwen2.5 files).
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
    except Exception as exc:  # safetensors wraps io errors in its own SafetensorError
        raise _disk_error(exc, tmp, need) or exc
    del tensors, parsed
    step(writing, need, need)
    write_config_and_tokenizer(tmp, config, tokenizer, type(model).__name__, torch_dtype)
    _check_saved(tmp, meta)


def _check_names(gguf_path: Path, model, config, tensors: dict) -> None:
    """ModelLoadError unless the GGUF's tensors are exactly the model's parameters (a tied
    lm_head may be absent: tied checkpoints store only the embedding)."""
    expected = set(model.state_dict())
    missing = expected - set(tensors)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if missing - allowed_missing or set(tensors) - expected:
        raise ModelLoadError(
            f"{gguf_path.name}: tensors do not match the {type(model).__name__} layout "
            f"(missing {sorted(missing - allowed_missing)[:5]}, "
            f"unexpected {sorted(set(tensors) - expected)[:5]})",
            "the GGUF file may come from a different architecture variant",
        )


def _check_free_space(where: Path, need: int) -> None:
    free = shutil.disk_usage(where).free
    if free < need * 1.05 + (64 << 20):
        raise AssetError(
            f"not enough disk space in {where} for the converted checkpoint: "
            f"{human_bytes(free)} free, ~{human_bytes(need)} needed",
            "free some space or point SSDLOCAL_CACHE at a larger disk, then rerun",
        )


def _unreadable(gguf_path: Path, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"transformers could not load {gguf_path.name}: {exc}",
        f"the file may use an unsupported quantization, or be damaged: {replace_hint(gguf_path)}",
    )


def read_config_and_tokenizer(gguf_path: Path) -> tuple[object, object]:
    """transformers' config and tokenizer built from a GGUF file's metadata (no weights read)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise _unreadable(gguf_path, exc) from exc
    meta = gguf_metadata(gguf_path)
    if meta["rope_scaling"] not in (None, "none") and not _scales_rope(config):  # e.g. Gemma 3 4B and larger
        raise unsupported(
            f"{meta['architecture']} GGUF with rope scaling {meta['rope_scaling']!r}, "
            "which transformers does not read from the file's metadata"
        )
    return config, tokenizer


def _scales_rope(config) -> bool:
    """Whether a transformers config states any rotary scaling (flat, or per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    return any(t.get("rope_type", t.get("type", "default")) != "default" for t in tables)


def write_config_and_tokenizer(out: Path, config, tokenizer, architecture: str, torch_dtype) -> None:
    """Save config.json, generation_config.json and the tokenizer files into `out`."""
    import numpy as np
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [architecture]
    # GGUF stores floats as float32: 1e-6 arrives as 9.99999997e-07. Keep the short form.
    if isinstance(getattr(config, "rms_norm_eps", None), float):
        config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    config.dtype = torch_dtype
    config.save_pretrained(out)
    gen = GenerationConfig.from_model_config(config)
    _set_generation_config(gen, tokenizer)
    gen.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _set_generation_config(gen: object, tokenizer: object) -> None:
    """eos ids = the tokenizer's eos plus known end-of-turn tokens found in the vocab."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    eos: list[int] = []
    for tid in (tokenizer.eos_token_id, *(vocab.get(t) for t in EXTRA_EOS)):  # type: ignore[attr-defined]
        if tid is not None and tid not in eos:
            eos.append(int(tid))
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.bos_token_id is not None:  # type: ignore[attr-defined]
        gen.bos_token_id = tokenizer.bos_token_id  # type: ignore[attr-defined]
    if tokenizer.pad_token_id is not None:  # type: ignore[attr-defined]
        gen.pad_token_id = tokenizer.pad_token_id  # type: ignore[attr-defined]


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


def check_chat_template(out: Path, meta: dict[str, object]) -> None:
    """A GGUF with a chat template must keep it in the saved tokenizer files."""
    from transformers import AutoTokenizer

    if meta.get("has_chat_template"):
        tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
        if not tok.chat_template:
            raise ModelLoadError(
                "the GGUF file has a chat template but the converted tokenizer lost it",
                "report a bug (transformers version mismatch?)",
            )
