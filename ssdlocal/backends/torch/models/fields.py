"""How a family reads a transformers config: the text model's config of a multimodal
checkpoint, rotary parameters in either of transformers' layouts, the refusal, by name, of a
field whose value a family does not implement, and the ModelArgs fields most families read
alike.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import unsupported


def text_config(cfg, described: Architecture):
    """The config the family reads: `cfg` itself, or for a multimodal checkpoint of
    `described` (its Multimodal claims the config) a copy of its `text_config` with the top
    level's tie_word_embeddings (transformers ties the whole model's head by it) and the
    fields that act on image or audio tokens only unset. Every other top-level field
    (image and audio token ids, the towers' configs) leaves text untouched; a text field the
    multimodal model ignores (Multimodal.unread) is refused by name when set."""
    multimodal = described.multimodal
    names, model_type = getattr(cfg, "architectures", None) or (), getattr(cfg, "model_type", None)
    if multimodal is None or not multimodal.claims(names, model_type):
        return cfg
    if getattr(cfg, "text_config", None) is None:
        raise unsupported(f"{', '.join(names) or model_type} without a text_config")
    text = copy.copy(cfg.text_config)
    refuse(f"{described.name} ({', '.join(names) or model_type})", text, **dict.fromkeys(multimodal.unread))
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    for name, value in multimodal.media_only.items():
        if getattr(text, name, None) == value:
            setattr(text, name, None)
    return text


def read_rope(rope: dict | None, cfg, arch: str, supported: Sequence[str] = ("default", "llama3", "linear")):
    """(theta, scaling) of rotary parameters as a config states them: transformers 5 keeps
    theta and scaling together (`rope_parameters`, or one entry of a per-layer-type dict:
    pass it as `rope`); 4.x split them (`rope_theta`, `rope_scaling`). A rope type outside
    `supported` is refused by name (UnsupportedArchitectureError)."""
    if rope is None:
        rope = getattr(cfg, "rope_parameters", None)
    if rope:
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = dict(rope)
    else:
        theta = getattr(cfg, "rope_theta", 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in supported:
        raise unsupported(f"{arch} with rope_type={kind!r}")
    return float(theta), None if kind == "default" else {**scaling, "rope_type": kind}


def refuse(arch: str, cfg, **expected: object) -> None:
    """UnsupportedArchitectureError naming the first config field whose value is not the
    one we implement (`field=value` pairs; a missing field counts as expected)."""
    for name, want in expected.items():
        got = getattr(cfg, name, want)
        same = bool(got) == want if isinstance(want, bool) else (not got if want is None else got == want)
        if not same:
            raise unsupported(f"{arch} with {name}={got!r}")


def common_fields(
    cfg,
    arch: str,
    rope: tuple[float, dict | None],
    *,
    tie: bool,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
) -> dict:
    """ModelArgs' fields as most families read them (`rope`: read_rope's (theta, scaling);
    `tie`: tie_word_embeddings when the config leaves it out; `kv_heads`, `head_dim`,
    `intermediate_size`: the family's own reading, where it has one, else the config's)."""
    heads = cfg.num_attention_heads
    return {
        "arch": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": intermediate_size if intermediate_size is not None else cfg.intermediate_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads if kv_heads is not None else getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim if head_dim is not None else getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope[0],
        "rope_scaling": rope[1],
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", tie)),
        "max_position_embeddings": cfg.max_position_embeddings,
    }
