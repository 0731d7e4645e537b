"""Tiny random-weight GGUFs of the 2026 families, as llama.cpp's loader reads them.

One layout per GGUF architecture (`qwen3moe`, `gpt-oss`, `gemma3`, `gemma4`, `qwen35`,
`qwen35moe`): the metadata keys and the tensor names and shapes that the llama.cpp built
by llama-cpp-python 0.3.36 requires for it (its `src/models/<family>.cpp`
`load_arch_hparams` / `load_arch_tensors`), at a hidden size of 64, a few layers and the
byte-level vocabulary of tiny_gguf.py (264 tokens, Qwen's chat tokens), in float32 so
that every test reads in seconds. Shapes are written as numpy shapes: llama.cpp's `ne`
reversed. Sliding windows are 8 tokens so that the tests' sequences outgrow them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from support.tiny_gguf import _add_chat_tokenizer, byte_vocab

FAMILIES = ("qwen3moe", "gpt-oss", "gemma3", "gemma4", "qwen35", "qwen35moe")
HYBRID = ("qwen35", "qwen35moe")  # Gated DeltaNet (recurrent) layers beside full attention
WINDOW = 8  # sliding-window layers see this many tokens


@dataclass
class Layout:
    """One family's GGUF: metadata (key without the `<arch>.` prefix -> value) and tensors
    (name -> numpy shape); `kind` names how a tensor's random values are drawn."""

    arch: str
    keys: dict[str, object] = field(default_factory=dict)
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kind: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, shape: tuple[int, ...], kind: str = "") -> None:
        self.tensors[name] = shape
        if kind:
            self.kind[name] = kind


@dataclass(frozen=True)
class Sizes:
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    experts: int = 4
    experts_used: int = 2
    expert_ffn: int = 32
    context: int = 512
    ssm_k_heads: int = 2  # Gated DeltaNet: key heads (ssm.group_count)
    ssm_v_heads: int = 4  # value heads (ssm.time_step_rank); their state is head_dim x head_dim


def _common(layout: Layout, s: Sizes, vocab: int, tied: bool) -> None:
    layout.keys.update(
        {
            "context_length": s.context,
            "embedding_length": s.hidden,
            "block_count": s.layers,
            "feed_forward_length": s.ffn,
            "attention.head_count": s.heads,
            "attention.head_count_kv": s.kv_heads,
            "attention.key_length": s.head_dim,
            "attention.value_length": s.head_dim,
            "attention.layer_norm_rms_epsilon": 1e-6,
            "rope.freq_base": 10000.0,
        }
    )
    layout.add("token_embd.weight", (vocab, s.hidden), "tied" if tied else "")
    layout.add("output_norm.weight", (s.hidden,), "norm")
    if not tied:
        layout.add("output.weight", (vocab, s.hidden))


def _attention(layout: Layout, i: int, s: Sizes, head_dim: int, *, q_factor: int = 1, bias: bool = False) -> None:
    """attn_q/k/v/output of block i (q rows times q_factor: Qwen3.5's gated queries)."""
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    layout.add(f"blk.{i}.attn_q.weight", (q * q_factor, s.hidden))
    layout.add(f"blk.{i}.attn_k.weight", (kv, s.hidden))
    layout.add(f"blk.{i}.attn_v.weight", (kv, s.hidden))
    layout.add(f"blk.{i}.attn_output.weight", (s.hidden, q))
    if bias:
        for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", s.hidden)):
            layout.add(f"blk.{i}.{name}.bias", (n,), "bias")


def _qk_norms(layout: Layout, i: int, head_dim: int) -> None:
    layout.add(f"blk.{i}.attn_q_norm.weight", (head_dim,), "norm")
    layout.add(f"blk.{i}.attn_k_norm.weight", (head_dim,), "norm")


def _dense_ffn(layout: Layout, i: int, s: Sizes) -> None:
    layout.add(f"blk.{i}.ffn_gate.weight", (s.ffn, s.hidden))
    layout.add(f"blk.{i}.ffn_up.weight", (s.ffn, s.hidden))
    layout.add(f"blk.{i}.ffn_down.weight", (s.hidden, s.ffn))


def _experts(layout: Layout, i: int, s: Sizes, *, bias: bool = False) -> None:
    e, f, h = s.experts, s.expert_ffn, s.hidden
    layout.add(f"blk.{i}.ffn_gate_inp.weight", (e, h))
    layout.add(f"blk.{i}.ffn_gate_exps.weight", (e, f, h))
    layout.add(f"blk.{i}.ffn_up_exps.weight", (e, f, h))
    layout.add(f"blk.{i}.ffn_down_exps.weight", (e, h, f))
    if bias:
        layout.add(f"blk.{i}.ffn_gate_inp.bias", (e,), "bias")
        layout.add(f"blk.{i}.ffn_gate_exps.bias", (e, f), "bias")
        layout.add(f"blk.{i}.ffn_up_exps.bias", (e, f), "bias")
        layout.add(f"blk.{i}.ffn_down_exps.bias", (e, h), "bias")


def _moe_keys(layout: Layout, s: Sizes) -> None:
    layout.keys.update(
        {"expert_count": s.experts, "expert_used_count": s.experts_used, "expert_feed_forward_length": s.expert_ffn}
    )


def qwen3moe(s: Sizes, vocab: int) -> Layout:
    """Qwen3-MoE: q/k norms, top-k routed experts (normalised weights), no shared expert."""
    layout = Layout("qwen3moe")
    _common(layout, s, vocab, tied=False)
    _moe_keys(layout, s)
    for i in range(s.layers):
        layout.add(f"blk.{i}.attn_norm.weight", (s.hidden,), "norm")
        _attention(layout, i, s, s.head_dim)
        _qk_norms(layout, i, s.head_dim)
        layout.add(f"blk.{i}.ffn_norm.weight", (s.hidden,), "norm")
        _experts(layout, i, s)
    return layout


def gpt_oss(s: Sizes, vocab: int) -> Layout:
    """gpt-oss: attention sinks and biases, alternating sliding-window / full layers (every
    second full), YaRN rope, experts with biases and the clamped SwiGLU."""
    layout = Layout("gpt-oss")
    _common(layout, s, vocab, tied=False)
    _moe_keys(layout, s)
    layout.keys.update(
        {
            "attention.sliding_window": WINDOW,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": s.context // 4,
        }
    )
    for i in range(s.layers):
        layout.add(f"blk.{i}.attn_norm.weight", (s.hidden,), "norm")
        _attention(layout, i, s, s.head_dim, bias=True)
        layout.add(f"blk.{i}.attn_sinks.weight", (s.heads,), "bias")
        layout.add(f"blk.{i}.post_attention_norm.weight", (s.hidden,), "norm")
        _experts(layout, i, s, bias=True)
    return layout


def gemma3(s: Sizes, vocab: int) -> Layout:
    """Gemma 3 text: sliding-window layers and a global one every sixth (llama.cpp's default
    pattern: llama.cpp's converter writes none, nor a local rope base: 10000), q/k norms,
    post-attention and post-FFN norms, tied embeddings (scaled by sqrt(hidden))."""
    s = replace(s, layers=6)  # five local layers, then the global one
    layout = Layout("gemma3")
    _common(layout, s, vocab, tied=True)
    layout.keys.update({"attention.sliding_window": WINDOW, "rope.freq_base": 1_000_000.0})
    for i in range(s.layers):
        layout.add(f"blk.{i}.attn_norm.weight", (s.hidden,), "norm")
        _attention(layout, i, s, s.head_dim)
        _qk_norms(layout, i, s.head_dim)
        layout.add(f"blk.{i}.post_attention_norm.weight", (s.hidden,), "norm")
        layout.add(f"blk.{i}.ffn_norm.weight", (s.hidden,), "norm")
        _dense_ffn(layout, i, s)
        layout.add(f"blk.{i}.post_ffw_norm.weight", (s.hidden,), "norm")
    return layout


def gemma4(s: Sizes, vocab: int) -> Layout:
    """Gemma 4 text (dense, no per-layer inputs, no shared KV): sliding-window layers with
    head_dim and their rope, global layers with twice the head_dim and proportional rope
    (rope_freqs: a quarter of the pairs rotated), final logit soft-capping."""
    layout = Layout("gemma4")
    _common(layout, s, vocab, tied=True)
    full_dim = 2 * s.head_dim
    pattern = [(i + 1) % s.layers != 0 for i in range(s.layers)]
    layout.keys.update(
        {
            "attention.sliding_window": WINDOW,
            "attention.sliding_window_pattern": pattern,
            "attention.shared_kv_layers": 0,
            "embedding_length_per_layer_input": 0,
            "attention.key_length": full_dim,
            "attention.value_length": full_dim,
            "attention.key_length_swa": s.head_dim,
            "attention.value_length_swa": s.head_dim,
            "rope.dimension_count": full_dim,
            "rope.dimension_count_swa": s.head_dim,
            "rope.freq_base": 1_000_000.0,
            "rope.freq_base_swa": 10000.0,
            "final_logit_softcapping": 30.0,
        }
    )
    rotated = full_dim // 2 // 4
    layout.add("rope_freqs.weight", (full_dim // 2,), f"rope_freqs:{rotated}")
    for i in range(s.layers):
        dim = s.head_dim if pattern[i] else full_dim
        layout.add(f"blk.{i}.attn_norm.weight", (s.hidden,), "norm")
        _attention(layout, i, s, dim)
        _qk_norms(layout, i, dim)
        layout.add(f"blk.{i}.post_attention_norm.weight", (s.hidden,), "norm")
        layout.add(f"blk.{i}.ffn_norm.weight", (s.hidden,), "norm")
        _dense_ffn(layout, i, s)
        layout.add(f"blk.{i}.post_ffw_norm.weight", (s.hidden,), "norm")
        layout.add(f"blk.{i}.layer_output_scale.weight", (1,), "norm")
    return layout


def _qwen35(arch: str, s: Sizes, vocab: int, moe: bool) -> Layout:
    """Qwen3.5: three Gated DeltaNet layers (short causal conv over q/k/v, a gated delta-rule
    state per value head) to one full-attention layer (gated queries, q/k norms, partial
    interleaved M-RoPE), a post-attention norm before the FFN."""
    layout = Layout(arch)
    _common(layout, s, vocab, tied=False)
    k_heads, v_heads, state = s.ssm_k_heads, s.ssm_v_heads, s.head_dim
    key_dim, value_dim = k_heads * state, v_heads * state
    layout.keys.update(
        {
            "rope.dimension_count": s.head_dim // 2,
            "rope.dimension_sections": [2, 1, 1, 0],
            "ssm.conv_kernel": 4,
            "ssm.state_size": state,
            "ssm.group_count": k_heads,
            "ssm.time_step_rank": v_heads,
            "ssm.inner_size": value_dim,
            "full_attention_interval": 4,
            "attention.recurrent_layers": [(i + 1) % 4 != 0 for i in range(s.layers)],  # as the converter writes
        }
    )
    if moe:
        _moe_keys(layout, s)
        layout.keys["expert_shared_feed_forward_length"] = s.expert_ffn
    for i in range(s.layers):
        layout.add(f"blk.{i}.attn_norm.weight", (s.hidden,), "norm")
        layout.add(f"blk.{i}.post_attention_norm.weight", (s.hidden,), "norm")
        if (i + 1) % 4 == 0:
            _attention(layout, i, s, s.head_dim, q_factor=2)
            _qk_norms(layout, i, s.head_dim)
        else:
            layout.add(f"blk.{i}.attn_qkv.weight", (2 * key_dim + value_dim, s.hidden))
            layout.add(f"blk.{i}.attn_gate.weight", (value_dim, s.hidden))
            layout.add(f"blk.{i}.ssm_conv1d.weight", (2 * key_dim + value_dim, 4))
            layout.add(f"blk.{i}.ssm_dt.bias", (v_heads,), "bias")
            layout.add(f"blk.{i}.ssm_a", (v_heads,), "decay")
            layout.add(f"blk.{i}.ssm_beta.weight", (v_heads, s.hidden))
            layout.add(f"blk.{i}.ssm_alpha.weight", (v_heads, s.hidden))
            layout.add(f"blk.{i}.ssm_norm.weight", (state,), "norm")
            layout.add(f"blk.{i}.ssm_out.weight", (s.hidden, value_dim))
        if moe:
            _experts(layout, i, s)
            layout.add(f"blk.{i}.ffn_gate_inp_shexp.weight", (s.hidden,))
            layout.add(f"blk.{i}.ffn_gate_shexp.weight", (s.expert_ffn, s.hidden))
            layout.add(f"blk.{i}.ffn_up_shexp.weight", (s.expert_ffn, s.hidden))
            layout.add(f"blk.{i}.ffn_down_shexp.weight", (s.hidden, s.expert_ffn))
        else:
            _dense_ffn(layout, i, s)
    return layout


BUILDERS = {
    "qwen3moe": qwen3moe,
    "gpt-oss": gpt_oss,
    "gemma3": gemma3,
    "gemma4": gemma4,
    "qwen35": lambda s, v: _qwen35("qwen35", s, v, moe=False),
    "qwen35moe": lambda s, v: _qwen35("qwen35moe", s, v, moe=True),
}


def layout_of(arch: str, sizes: Sizes | None = None) -> Layout:
    """The family's layout at `sizes` (default: the tiny ones) over tiny_gguf's vocabulary."""
    tokens, _ = byte_vocab()
    return BUILDERS[arch](sizes or Sizes(), len(tokens))


def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Random values: norms near 1, biases small, decays negative (A = -exp(a)), tied
    embeddings small, rope
    factors 1 for the rotated pairs and 1e30 for the rest (as llama.cpp's converter writes
    Gemma 4's), matrices scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "bias":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "decay":
        return -np.exp(0.3 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "tied":  # Gemma scales its embeddings by sqrt(hidden): smaller rows keep
        # the residual stream from repeating the input token (which full-size ones do)
        return (0.25 * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if kind.startswith("rope_freqs:"):
        rotated = int(kind.split(":")[1])
        return np.array([1.0] * rotated + [1e30] * (shape[0] - rotated), dtype=np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def write_family_gguf(
    path: Path,
    arch: str,
    seed: int = 0,
    sizes: Sizes | None = None,
    *,
    jitter: float = 0.0,
    jitter_seed: int = 1,
    q8: bool = False,
    experts: str = "f32",
) -> Path:
    """Write a GGUF of family `arch` with random weights drawn from `seed`; `jitter` > 0 adds
    that fraction of noise (drawn from `jitter_seed`) to every matrix: a draft that agrees
    with the jitter-free model often, not always. `q8`: matrices whose rows are whole
    32-blocks in Q8_0 (llama.cpp's quantized kernels), the rest float32. `experts`: "mxfp4" stores
    the stacked experts' weights in MXFP4, as llama.cpp's converter writes gpt-oss's;
    "mxfp4-values" stores the values those hold, in float32."""
    import gguf

    layout = layout_of(arch, sizes)
    tokens, merges = byte_vocab()
    w = gguf.GGUFWriter(str(path), layout.arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    for key, value in layout.keys.items():
        _add_key(w, f"{layout.arch}.{key}", value)
    _add_chat_tokenizer(w, tokens, merges)
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(jitter_seed)
    for name, shape in layout.tensors.items():
        data = _values(rng, shape, layout.kind.get(name, ""))
        if jitter and data.ndim >= 2:
            data = data + (jitter * data.std() * noise.standard_normal(shape)).astype(np.float32)
        if experts != "f32" and name.endswith("_exps.weight"):
            raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)
            if experts == "mxfp4":
                w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            else:
                w.add_tensor(name, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4))
        elif q8 and name.endswith(".weight") and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_key(w, key: str, value: object) -> None:
    """One metadata entry in the GGUF type llama.cpp reads it as (u32, f32, string, arrays
    of i32 or bool)."""
    import gguf

    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif value and isinstance(value[0], bool):  # type: ignore[index]
        w.add_array(key, list(value))  # type: ignore[arg-type]
    else:
        w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)  # type: ignore[arg-type]
