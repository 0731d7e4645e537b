"""Convert a GGUF file (Llama / Qwen2 / Qwen3) once into a cached HF-format checkpoint.

transformers dequantizes the GGUF tensors to dense weights (slow: ~50 s for a 1.5B);
we save the result as config.json + model.safetensors + tokenizer files +
generation_config.json so the native torch loader reads it in seconds afterwards.
The cache key is the GGUF file's name, size and mtime plus the dtype. This module
knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from ssdlocal.core.errors import (
    ModelLoadError,
    UnsupportedArchitectureError,
    UsageError,
)
from ssdlocal.core.paths import ProgressCallback, cache_dir

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_DTYPES = ("bfloat16", "float16", "float32")
_MARKER = "ssdlocal-convert.json"
# End-of-turn tokens that chat models emit; added to eos ids when present in the vocab.
_EXTRA_EOS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
_STEPS = 4  # convert progress: read, dequantize, save weights, save tokenizer


def gguf_metadata(gguf_path: Path) -> dict[str, object]:
    """A few header fields of a GGUF file (architecture, name, chat template present)."""
    try:  # transformers >= 5 has a header reader that skips big arrays (30 ms, not 6 s)
        from transformers.integrations.gguf.reader import read_gguf_metadata

        def read(path: str) -> dict[str, object]:
            return read_gguf_metadata(path, ())[0]
    except ImportError:
        read = _read_with_gguf
    try:
        fields = read(str(gguf_path))
    except ImportError as exc:
        raise ModelLoadError(
            "reading GGUF files needs the `gguf` package", "pip install 'ssdlocal[torch]'"
        ) from exc
    except Exception as exc:  # readers raise ValueError/struct errors on junk files
        raise ModelLoadError(
            f"{gguf_path} is not a readable GGUF file: {exc}",
            "delete it and fetch it again, or pass another model path",
        ) from exc
    return {
        "architecture": fields.get("general.architecture"),
        "name": fields.get("general.name"),
        "has_chat_template": bool(fields.get("tokenizer.chat_template")),
    }


def _read_with_gguf(path: str) -> dict[str, object]:
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    keys = ("general.architecture", "general.name", "tokenizer.chat_template")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def converted_dir(gguf_path: Path, dtype: str = "bfloat16", root: Path | None = None) -> Path:
    """The cache directory for `gguf_path` converted to `dtype` (may not exist yet)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    stem = gguf_path.name.removesuffix(".gguf")
    return (root or cache_dir() / "converted") / f"{stem}-{dtype}-{key[:12]}"


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
    if (out / _MARKER).is_file():
        return out

    meta = gguf_metadata(gguf_path)
    arch = str(meta["architecture"])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{gguf_path.name} has architecture {arch!r}, which ssdlocal does not implement",
            f"supported GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        _convert(gguf_path, tmp, dtype, meta, progress)
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "source": gguf_path.name,
                    "size": gguf_path.stat().st_size,
                    "mtime_ns": gguf_path.stat().st_mtime_ns,
                    "architecture": arch,
                    "dtype": dtype,
                    "seconds": round(time.perf_counter() - t0, 1),
                },
                indent=1,
            )
            + "\n"
        )
        try:
            os.replace(tmp, out)  # atomic when `out` does not exist
        except OSError:
            if not (out / _MARKER).is_file():  # not a concurrent winner: a stale dir
                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1fs", gguf_path.name, out, time.perf_counter() - t0)
    return out


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

    def step(i: int) -> None:
        if progress:
            progress("convert", i, _STEPS)

    torch_dtype = getattr(torch, dtype)
    step(0)
    config, tokenizer = read_config_and_tokenizer(gguf_path)
    step(1)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch_dtype
        )
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise _unreadable(gguf_path, exc) from exc
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    step(2)
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
    tmp.mkdir(parents=True)
    # Tied checkpoints store only model.embed_tokens.weight (like HF's own Qwen2.5 files).
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt"},
    )
    del tensors, parsed
    step(3)
    write_config_and_tokenizer(tmp, config, tokenizer, type(model).__name__, torch_dtype)
    _check_saved(tmp, meta)
    step(4)


def _unreadable(gguf_path: Path, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"transformers could not load {gguf_path.name}: {exc}",
        "the file may be damaged (delete and fetch again) or use an unsupported quantization",
    )


def read_config_and_tokenizer(gguf_path: Path) -> tuple[object, object]:
    """transformers' config and tokenizer built from a GGUF file's metadata (no weights read)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        return (AutoConfig.from_pretrained(folder, gguf_file=name),
                AutoTokenizer.from_pretrained(folder, gguf_file=name))  # fmt: skip
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise _unreadable(gguf_path, exc) from exc


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
    for tid in (tokenizer.eos_token_id, *(vocab.get(t) for t in _EXTRA_EOS)):  # type: ignore[attr-defined]
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
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.get("tie_word_embeddings", False):
        needed.add("lm_head.weight")  # tied checkpoints store only the embedding
    missing = needed - keys
    if missing:
        raise ModelLoadError(
            f"converted checkpoint lacks tensors {sorted(missing)}", "report a bug"
        )
    check_chat_template(tmp, meta)


def check_chat_template(out: Path, meta: dict[str, object]) -> None:
    """A GGUF with a chat template must keep it in the saved tokenizer files."""
    from transformers import AutoTokenizer

    if meta.get("has_chat_template"):
        tok = AutoTokenizer.from_pretrained(str(out))
        if not tok.chat_template:
            raise ModelLoadError(
                "the GGUF file has a chat template but the converted tokenizer lost it",
                "report a bug (transformers version mismatch?)",
            )
