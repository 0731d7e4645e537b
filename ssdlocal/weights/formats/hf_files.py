"""A GGUF file's config and tokenizer as transformers reads them from its metadata, saved as
a checkpoint's config.json, generation_config.json and tokenizer files (eos ids: the
tokenizer's plus the end-of-turn tokens chat models emit). What the GGUF metadata
directory (metadata.py) writes and the converters check. Knows nothing about weights.
"""

from __future__ import annotations

from pathlib import Path

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.paths import replace_hint

# End-of-turn tokens that chat models emit; added to eos ids when present in the vocab.
EXTRA_EOS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")


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
        return (
            AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False),
            AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False),
        )
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise _unreadable(gguf_path, exc) from exc


def scales_rope(config: dict) -> bool:
    """Whether a config.json states any rotary scaling (flat, or per layer type)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
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
