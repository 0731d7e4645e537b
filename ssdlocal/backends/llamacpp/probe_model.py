"""A tiny random GGUF model for probing llama.cpp on this machine, written here without the
network and without the `gguf` package (standard library and numpy only).

A 2-layer llama-architecture model (hidden 256, vocabulary 320) whose matrices use the
block types llama.cpp repacks for the CPU's vector units (Q4_K, Q4_0, Q8_0) and the
Q6_K of a Q4_K_M file; each block is random bytes under a small fixed scale, so every
weight is finite. The vocabulary is GPT-2 style bytes with two merges, enough for
llama.cpp to load it. Only the file format matters here, not what the model says.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 2, 4, 2, 128
_ALIGN = 32
# ggml type: (id, values per block, bytes per block)
_TYPES = {"F32": (0, 1, 4), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
# GGUF metadata value types
_U32, _I32, _F32, _STR, _ARR = 4, 5, 6, 8, 9
_MERGES = ["Ġ t", "h e"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): bytes, merges, specials, then reserved tokens up to VOCAB."""
    tokens = byte_tokens() + [m.replace(" ", "") for m in _MERGES] + _SPECIALS
    n_normal = len(tokens) - len(_SPECIALS)
    tokens += [f"<|reserved_{i}|>" for i in range(VOCAB - len(tokens))]
    return tokens, [1] * n_normal + [3] * (VOCAB - n_normal)  # 1 normal, 3 control


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value) -> bytes:
    if kind == _STR:
        return _string(value)
    if kind == _ARR:
        elem, items = value
        body = b"".join(_string(v) if elem == _STR else struct.pack("<i" if elem == _I32 else "<I", v) for v in items)
        return struct.pack("<IQ", elem, len(items)) + body
    return struct.pack({_U32: "<I", _I32: "<i", _F32: "<f"}[kind], value)


def _metadata() -> list[tuple[str, int, object]]:
    tokens, types = vocabulary()
    return [
        ("general.architecture", _STR, "llama"),
        ("general.name", _STR, "ssdlocal-probe"),
        ("general.file_type", _U32, 15),  # mostly Q4_K_M
        ("llama.context_length", _U32, CONTEXT),
        ("llama.embedding_length", _U32, HIDDEN),
        ("llama.block_count", _U32, LAYERS),
        ("llama.feed_forward_length", _U32, FFN),
        ("llama.attention.head_count", _U32, HEADS),
        ("llama.attention.head_count_kv", _U32, KV_HEADS),
        ("llama.attention.layer_norm_rms_epsilon", _F32, 1e-6),
        ("llama.rope.dimension_count", _U32, HIDDEN // HEADS),
        ("llama.rope.freq_base", _F32, 10000.0),
        ("llama.vocab_size", _U32, VOCAB),
        ("tokenizer.ggml.model", _STR, "gpt2"),
        ("tokenizer.ggml.pre", _STR, "default"),
        ("tokenizer.ggml.tokens", _ARR, (_STR, tokens)),
        ("tokenizer.ggml.token_type", _ARR, (_I32, types)),
        ("tokenizer.ggml.merges", _ARR, (_STR, _MERGES)),
        ("tokenizer.ggml.bos_token_id", _U32, tokens.index("<|endoftext|>")),
        ("tokenizer.ggml.eos_token_id", _U32, tokens.index("<|im_end|>")),
    ]


def _tensors() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape [in, out], type): layer 0 like Q4_K_M, layer 1 Q4_0 / Q8_0."""
    kv = HIDDEN // HEADS * KV_HEADS
    out = [
        ("token_embd.weight", (HIDDEN, VOCAB), "Q8_0"),
        ("output_norm.weight", (HIDDEN,), "F32"),
        ("output.weight", (HIDDEN, VOCAB), "Q6_K"),
    ]
    for i, (main, side) in enumerate((("Q4_K", "Q6_K"), ("Q4_0", "Q8_0"))):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (HIDDEN,), "F32"),
            (b + "ffn_norm.weight", (HIDDEN,), "F32"),
            (b + "attn_q.weight", (HIDDEN, HIDDEN), main),
            (b + "attn_k.weight", (HIDDEN, kv), main),
            (b + "attn_v.weight", (HIDDEN, kv), side),
            (b + "attn_output.weight", (HIDDEN, HIDDEN), main),
            (b + "ffn_gate.weight", (HIDDEN, FFN), main),
            (b + "ffn_up.weight", (HIDDEN, FFN), main),
            (b + "ffn_down.weight", (FFN, HIDDEN), side),
        ]
    return out


def _data(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> bytes:
    """Random blocks of `kind` with their fp16 scales set small (finite weights)."""
    if kind == "F32":
        return np.ones(shape, dtype=np.float32).tobytes()  # norms: 1
    _, per_block, size = _TYPES[kind]
    n_blocks = int(np.prod(shape)) // per_block
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    half = lambda x: np.full((n_blocks, 1), x, np.float16).view(np.uint8)  # noqa: E731
    if kind in ("Q4_0", "Q8_0"):
        blocks[:, 0:2] = half(0.01 if kind == "Q4_0" else 0.002)  # d
    elif kind == "Q4_K":
        blocks[:, 0:2], blocks[:, 2:4] = half(0.001), half(0.001)  # d, dmin
    else:  # Q6_K: d is the last field
        blocks[:, -2:] = half(0.0005)
    return blocks.tobytes()


def write_probe_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the probe model to `path` (about 1 MB) and return it."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    meta = _metadata()
    tensors = _tensors()
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, kind, v in meta)
    blobs, offset = [], 0
    for name, shape, kind in tensors:
        blob = _data(shape, kind, rng)
        head += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        head += struct.pack("<IQ", _TYPES[kind][0], offset)
        blob += b"\0" * (-len(blob) % _ALIGN)
        blobs.append(blob)
        offset += len(blob)
    head += b"\0" * (-len(head) % _ALIGN)
    path.write_bytes(head + b"".join(blobs))
    return path
