"""The two sides of a GGUF checked against llama.cpp: llama-cpp-python's own evaluation of
the file in float32 throughout, and the torch backend's logits on the file's float32
conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch


def llamacpp(path: Path):
    """llama-cpp-python's `Llama` on `path`: float32 KV cache and no flash attention, so
    that a float32 file is computed in float32 (its defaults keep K/V in float16)."""
    pytest.importorskip("llama_cpp")
    from ssdlocal.backends.llamacpp.lib import high_level_llama

    return high_level_llama(
        model_path=str(path),
        n_ctx=256,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=0,
        type_v=0,
        flash_attn=False,
    )


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids` [T, V], in one call."""
    llm = llamacpp(path)
    llm.eval(ids)
    return np.array([llm.scores[i] for i in range(len(ids))], dtype=np.float32)


def llamacpp_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """llama.cpp's own greedy decoding: the prompt, then one token per call."""
    llm = llamacpp(path)
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def torch_logits(path: Path, ids: list[int]) -> np.ndarray:
    """The torch backend's logits at every position of `ids` [T, V], the GGUF converted in
    float32 (the loader's own conversion of a GGUF is bfloat16)."""
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.backends.torch.models import causal_mask
    from ssdlocal.weights.formats.convert import ensure_converted

    model = load_model(ensure_converted(path, dtype="float32"), "cpu", "float32").model
    t = len(ids)
    pos = torch.arange(t)[None]
    model.setup_cache(1, t, torch.float32, "cpu")
    with torch.inference_mode():
        return model(torch.tensor([ids]), pos, pos, causal_mask(pos, t))[0].numpy()
