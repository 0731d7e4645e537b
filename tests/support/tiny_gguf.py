"""Tiny GGUF files for the quantization tests: Q4_K_M-like (Q4_K + Q6_K) and Q8_0 mixes.

The `gguf` package decodes every type but encodes only a few (no K-quants), so Q4_K and
Q6_K blocks are encoded here, in numpy, in ggml's block layout; the tests check them
against gguf.quants.dequantize, which stays the reference decoder. Weights come from a
random transformers model, laid out the way llama.cpp's converter writes them (llama's
q/k rows permuted per head), so loading must undo exactly what llama.cpp does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "d e", "Ġ f"]
    return chars + [m.replace(" ", "") for m in merges] + SPECIALS, merges


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """W [N, K] (K % 256 == 0) -> Q4_K bytes [N, K/256*144]: per 32 weights a 6-bit scale
    and min under per-256 fp16 super-scales, 4-bit values (ggml's layout)."""
    n = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 8, 32)  # [nb, 8, 32]
    lo = np.minimum(x.min(-1), 0.0)  # [nb, 8] (mins are stored as non-negative offsets)
    scale = (x.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)  # [nb]
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)  # [nb]
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # [nb, 8]
    q = np.round((x + (dmin[:, None] * m)[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [nb, 8, 32]
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )  # [nb, 12]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # [nb, 4 * 32]
    blocks = np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=-1)  # [nb, 144]
    return blocks.reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """W [N, K] (K % 256 == 0) -> Q6_K bytes [N, K/256*210]: int8 scale per 16 weights
    under an fp16 super-scale, 6-bit signed values (ggml's layout)."""
    n = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)  # [nb, 16, 16]
    s = np.abs(x).max(-1) / 31  # [nb, 16]
    d = (s.max(-1) / 127).astype(np.float16).astype(np.float32)  # [nb]
    sc = np.clip(np.round(s / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.round(x / np.where(step == 0, 1, step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 256).astype(np.uint8)  # [nb, 256] in 0..63
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for h in range(2):
        half = q[:, h * 128 : (h + 1) * 128]
        ql[:, h * 64 : h * 64 + 64] = (half[:, :64] & 15) | ((half[:, 64:] & 15) << 4)
        for part in range(4):
            qh[:, h * 32 : h * 32 + 32] |= (half[:, part * 32 : part * 32 + 32] >> 4) << (2 * part)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=-1)  # [nb, 210]
    return blocks.reshape(n, -1)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_hf_model(
    arch: str,
    seed: int = 0,
    tie: bool = False,
    hidden: int = 256,
    ffn: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokens, _ = byte_vocab()
    common = {
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "initializer_range": 0.1,
    }
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0)).eval()


def tensor_type(gguf_name: str, mix: str) -> str:
    """The ggml type of a 2-D weight under `mix` (q4_k_m: Q6_K for v, down and the output
    matrix, Q4_K for the rest, the embedding included, as in the offline 1.5B's file)."""
    if mix == "q8_0":
        return "Q8_0"
    if mix == "f32":
        return "F32"
    return "Q6_K" if any(p in gguf_name for p in ("attn_v", "ffn_down", "output.")) else "Q4_K"


def write_gguf(
    path: Path, model, arch: str, mix: str, *, file_arch: str | None = None, tensor_name=None, extra=None
) -> Path:
    """Write `model` (a transformers llama/qwen2, or gemma3 with `extra`) as a GGUF with the
    `mix` of types.

    file_arch: its general.architecture (default `arch`); tensor_name(hf module name) ->
    the GGUF's (default: llama.cpp's names for `arch`); extra(writer): more metadata."""
    import gguf

    cfg = model.config
    tokens, merges = byte_vocab()
    w = gguf.GGUFWriter(str(path), file_arch or arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    file_type = {
        "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "f32": gguf.LlamaFileType.ALL_F32,
    }[mix]
    w.add_file_type(file_type)
    if extra is not None:
        extra(w)
    _add_chat_tokenizer(w, tokens, merges)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    tensor_name = tensor_name or names.get_name
    for hf_name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{tensor_name(stem)}.{suffix}"
        data = tensor.float().numpy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            n_head = cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads
            data = _llama_permute(data, n_head)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's (1 + weight)
        kind = tensor_type(f"{names.get_name(stem)}.{suffix}", mix) if data.ndim == 2 else "F32"
        _add(w, name, data, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_gemma3(seed: int = 0):
    """A tiny Gemma 3 of the byte vocabulary, with the settings transformers assumes for a
    gemma3 GGUF (every sixth layer global, query_pre_attn_scalar 256, local theta 1e4)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(byte_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=256,
        sliding_window=8,
        max_position_embeddings=128,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        initializer_range=0.1,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


def gemma3_metadata(model, rope_scaling: str | None = None):
    """extra(writer) for `write_gguf`: what llama.cpp writes for a Gemma 3."""

    def extra(w) -> None:
        w.add_key_length(model.config.head_dim)
        w.add_value_length(model.config.head_dim)
        w.add_sliding_window(model.config.sliding_window)
        if rope_scaling is not None:
            w.add_rope_scaling_type(getattr(__import__("gguf").RopeScalingType, rope_scaling.upper()))
            w.add_rope_scaling_factor(8.0)

    return extra


def _add_tokenizer(w, tokens: list[str], merges: list[str]) -> None:
    """The byte-level BPE tokenizer of `tokens`/`merges` (its last three tokens special) with
    Qwen's end-of-turn token as eos, as a GGUF's metadata."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))


def _add_chat_tokenizer(w, tokens: list[str], merges: list[str]) -> None:
    """`_add_tokenizer`, with bos/pad and the chat template."""
    _add_tokenizer(w, tokens, merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)


def _add(writer, name: str, data: np.ndarray, kind: str) -> None:
    import gguf

    if kind == "F32":
        writer.add_tensor(name, data)
        return
    if kind == "Q8_0":
        raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    else:
        raw = encode_q4_k(data) if kind == "Q4_K" else encode_q6_k(data)
    writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))


def write_random_gguf(
    path: Path, *, hidden: int, ffn: int, layers: int, heads: int = 8, kv_heads: int = 2, seed: int = 0
) -> tuple[Path, int]:
    """A Q4_K_M-like qwen2 GGUF of random weights, built one tensor at a time (for memory
    tests: no transformers model of that size is ever created). Returns (path, parameters)."""
    import gguf

    tokens, merges = byte_vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (
        ("context_length", 128),
        ("embedding_length", hidden),
        ("block_count", layers),
        ("feed_forward_length", ffn),
        ("head_count", heads),
        ("head_count_kv", kv_heads),
    ):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _add_tokenizer(w, tokens, merges)
    kv = hidden // heads * kv_heads
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (hidden,),
                f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.attn_q.weight": (hidden, hidden),
                f"blk.{i}.attn_q.bias": (hidden,),
                f"blk.{i}.attn_k.weight": (kv, hidden),
                f"blk.{i}.attn_k.bias": (kv,),
                f"blk.{i}.attn_v.weight": (kv, hidden),
                f"blk.{i}.attn_v.bias": (kv,),
                f"blk.{i}.attn_output.weight": (hidden, hidden),
                f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                f"blk.{i}.ffn_up.weight": (ffn, hidden),
                f"blk.{i}.ffn_down.weight": (hidden, ffn),
            }
        )
    params = 0
    for name, shape in shapes.items():
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        params += data.size
        _add(w, name, data, tensor_type(name, "q4_k_m") if data.ndim == 2 else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, params


def write_tiny_gguf(
    path: Path, arch: str = "qwen2", seed: int = 0, context: int = 128, layers: int = 2, swap_tokens: bool = False
):
    """A random Qwen2 (2 layers unless told) as an F32 GGUF (`context` positions); returns the
    HF model it was made from. `swap_tokens`: two token texts trade ids (a tokenizer the pair
    check refuses)."""
    import gguf

    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokens, merges = byte_vocab()
    if swap_tokens:
        tokens[200], tokens[201] = tokens[201], tokens[200]
    cfg = Qwen2Config(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(context)
    w.add_embedding_length(32)
    w.add_block_count(layers)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_chat_tokenizer(w, tokens, merges)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, layers)
    for hf_name, tensor in model.state_dict().items():
        stem, suffix = hf_name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
