"""Quantized weights as floats, for the quantization tests: the weight a QuantLinear
multiplies by, and a float checkpoint holding a quantized model's weights de-quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ssdlocal.backends.torch.quant import QuantLinear


def effective_weight(lin: QuantLinear) -> torch.Tensor:
    """W [N, K] as the kernel applies it (fp32 modules): the outputs for the unit inputs."""
    eye = torch.eye(lin.in_features)
    bias = 0 if lin.bias is None else lin.bias
    return (lin(eye) - bias).t()


def dequantized_copy(src: Path, dst: Path, loaded) -> Path:
    """A float checkpoint whose linears hold `loaded`'s quantized weights, de-quantized."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = {}
    for f in sorted(dst.glob("*.safetensors")):
        state.update(load_file(f))
        f.unlink()
    for name, module in loaded.model.named_modules():
        if isinstance(module, QuantLinear):
            key = name if name == "lm_head" else f"model.{name}"
            state[f"{key}.weight"] = effective_weight(module).contiguous()
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = False  # the quantized lm_head is its own matrix
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
