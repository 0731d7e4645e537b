"""config.json fields a GGUF file states that transformers' GGUF reader misreads or leaves
out, read as llama.cpp reads them, for the families that need more than a key -> field map
(the description's `gguf_config`, weights/formats/gguf_tensors.py).

gpt-oss (llama.cpp's "gpt-oss"): the rotary table (transformers' reader fails on a file's
`rope.scaling.*` keys and, without them, keeps GptOssConfig's default YaRN; llama.cpp reads
the type, factor and original context and always rounds YaRN's correction range to whole
dimensions, transformers' `truncate`), the head size and which layers slide
(`attention.sliding_window_pattern`, every second layer by default). Gemma 4 ("gemma4"):
transformers' reader keeps Gemma4TextConfig's defaults for the sliding layers' head size,
the per-layer input width and the soft-capping; the global layers' proportional rotary
table is llama.cpp's `rope_freqs` tensor (1 for each rotated pair, 1e30 for the others).
Only the dense text model without per-layer inputs, shared KV, double-wide MLPs or keys as
values is read. A key that llama.cpp reads with another meaning than ours, or ignores
where a checkpoint's config would not, is refused by name (UnsupportedArchitectureError).
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ssdlocal.weights.formats.arch import GGUF_NAMES
from ssdlocal.weights.formats.archs import architecture, unsupported
from ssdlocal.weights.formats.gguf import GGUFHeader, dequantize_rows

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_FREQS = GGUF_NAMES.ignored[0]  # llama.cpp's rotary factors: nothing loads them as a weight
YARN_BETAS = (32.0, 1.0)  # beta_fast, beta_slow: llama.cpp's gpt-oss reads no others
# YaRN keys llama.cpp's gpt-oss ignores or applies unlike transformers, with the value that
# means nothing (a file stating another is refused)
_NEUTRAL = {
    "rope.scaling.yarn_beta_fast": YARN_BETAS[0],
    "rope.scaling.yarn_beta_slow": YARN_BETAS[1],
    "rope.scaling.yarn_ext_factor": 1.0,
    "rope.scaling.yarn_attn_factor": 1.0,
    "rope.scaling.yarn_log_multiplier": 0.0,
    "rope.scaling.attn_factor": 1.0,
}


def _gpt_oss(meta: Mapping[str, object], prefix: str) -> dict[str, object]:
    def key(name: str, default: object = None) -> object:
        return meta.get(prefix + name, default)

    name = "gpt-oss GGUF"
    heads = int(key("attention.head_count", 1))  # type: ignore[call-overload]
    head_dim = key("attention.key_length", int(key("embedding_length", 0)) // heads)  # type: ignore[call-overload]
    for other in ("attention.value_length", "rope.dimension_count"):
        if key(other, head_dim) != head_dim:
            raise unsupported(f"{name} with {other}={key(other)!r} (attention.key_length={head_dim!r})")
    theta = float(key("rope.freq_base", 10000.0))  # type: ignore[arg-type]
    if float(key("rope.freq_base_swa", theta)) != theta:  # type: ignore[arg-type]
        raise unsupported(f"{name} with rope.freq_base_swa={key('rope.freq_base_swa')!r}")
    kind = key("rope.scaling.type", "linear")  # llama.cpp's default
    factor = float(key("rope.scaling.factor", 0.0) or 0.0)  # type: ignore[arg-type]
    if kind == "yarn":
        for field, neutral in _NEUTRAL.items():
            got = key(field, neutral)
            if float(got) != neutral:  # type: ignore[arg-type]
                raise unsupported(f"{name} with {field}={got!r}")
    elif float(key("rope.scaling.attn_factor", 1.0)) != 1.0:  # type: ignore[arg-type]
        raise unsupported(f"{name} with rope.scaling.attn_factor={key('rope.scaling.attn_factor')!r}")
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": theta}
    if kind == "none" or (kind in ("linear", "yarn") and factor in (0.0, 1.0)):
        pass  # llama.cpp: no scaling (a factor of 1 leaves YaRN's table the plain one)
    elif kind == "linear":
        rope.update(rope_type="linear", factor=factor)
    elif kind == "yarn":
        original = key("rope.scaling.original_context_length", key("context_length"))
        rope.update(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=int(original),  # type: ignore[call-overload]
            beta_fast=YARN_BETAS[0],
            beta_slow=YARN_BETAS[1],
            truncate=True,  # ggml_rope_yarn_corr_dims: floor / ceil
        )
    else:
        raise unsupported(f"{name} with rope.scaling.type={kind!r}")
    layers = int(key("block_count"))  # type: ignore[call-overload]
    pattern = key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):  # one flag per layer: true slides
        if len(pattern) != layers:
            raise unsupported(f"{name} with {len(pattern)} sliding_window_pattern flags for {layers} layers")
        slides = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: the last of every n is full (n = 0: all slide)
        n = int(pattern)  # type: ignore[call-overload]
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    return {
        "head_dim": head_dim,
        "rope_parameters": rope,
        "layer_types": [SLIDING if s else FULL for s in slides],
    }


def _one(value: object, what: str) -> object:
    """A per-layer key's value where every layer has the same (refused otherwise)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise unsupported(f"gemma4 GGUF with {what} differing between layers")
        return value[0]
    return value


def _gemma4(header: GGUFHeader, prefix: str) -> dict[str, object]:
    meta = header.metadata

    def key(name: str, default: object = None) -> object:
        return meta.get(prefix + name, default)

    name = "gemma4 GGUF"
    for field, neutral in (
        ("embedding_length_per_layer_input", 0),
        ("attention.shared_kv_layers", 0),
        ("expert_count", 0),
        ("rope.scaling.factor", 0.0),
        ("rope.scaling.attn_factor", 1.0),
    ):
        if key(field, neutral) != neutral:
            raise unsupported(f"{name} with {field}={key(field)!r}")
    if key("rope.scaling.type", "none") not in ("none", "linear"):  # linear without a factor: none
        raise unsupported(f"{name} with rope.scaling.type={key('rope.scaling.type')!r}")
    full, local = key("attention.key_length"), key("attention.key_length_swa")
    for field, want in (
        ("attention.value_length", full),
        ("rope.dimension_count", full),
        ("attention.value_length_swa", local),
        ("rope.dimension_count_swa", local),
    ):
        if key(field, want) != want:
            raise unsupported(f"{name} with {field}={key(field)!r}")
    pattern = key("attention.sliding_window_pattern")
    layers = int(key("block_count"))  # type: ignore[call-overload]
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise unsupported(f"{name} with attention.sliding_window_pattern={pattern!r}")
    names = {t.name for t in header.tensors}
    v_proj = architecture("gemma4").gguf.theirs
    if any(v_proj(f"layers.{i}.self_attn.v_proj.weight") not in names for i in range(layers)):
        raise unsupported(f"{name} with keys as values (a layer without attn_v)")
    ffn = _one(key("feed_forward_length"), "feed_forward_length")
    kv_heads = _one(key("attention.head_count_kv"), "attention.head_count_kv")
    _one(key("attention.head_count"), "attention.head_count")
    factors = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if factors is None:
        raise unsupported(f"{name} without rope_freqs")
    values = dequantize_rows(header.path, factors, 0, 1).reshape(-1)
    rotated = int((values == 1.0).sum())
    if not (values[:rotated] == 1.0).all() or not (values[rotated:] >= 1e29).all():
        raise unsupported(f"{name} with rope_freqs other than ones then 1e30")
    theta = float(key("rope.freq_base", 10000.0))  # type: ignore[arg-type]
    return {
        "head_dim": local,
        "layer_types": [SLIDING if p else FULL for p in pattern],
        "sliding_window": key("attention.sliding_window"),
        "intermediate_size": ffn,
        "num_key_value_heads": kv_heads,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": False,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", theta))},  # type: ignore[arg-type]
            FULL: {"rope_type": "proportional", "partial_rotary_factor": rotated / len(values), "rope_theta": theta},
        },
    }


# GGUF general.architecture -> its reader (header, "{architecture}." prefix) -> config fields
READERS: dict[str, Callable[[GGUFHeader, str], dict[str, object]]] = {
    "gpt-oss": lambda header, prefix: _gpt_oss(header.metadata, prefix),
    "gemma4": _gemma4,
}


def llamacpp_fields(header: GGUFHeader) -> dict[str, object]:
    """The fields of a GGUF file (its `header`) that its family's reader states (none for
    a family without one)."""
    arch = str(header.metadata.get("general.architecture"))
    reader = READERS.get(arch)
    return reader(header, f"{arch}.") if reader else {}
