"""A Qwen3.5 checkpoint as published: besides the model it holds the multi-token-prediction
layer (`mtp.*` tensors), which nothing loads yet (no drafter reads it). Such a checkpoint
loads, computes the same logits as without those tensors, and is sized without them."""

from __future__ import annotations

import shutil

import torch
from support.tiny_families import make_qwen3_5
from support.tiny_models import build_tokenizer

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import causal_mask


def test_mtp_tensors_are_skipped_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from ssdlocal.weights.size import parameters

    build_tokenizer(tmp_path / "tokenizer")
    plain = make_qwen3_5(tmp_path / "plain", tmp_path / "tokenizer")
    with_mtp = shutil.copytree(plain, tmp_path / "with_mtp")
    (file,) = with_mtp.glob("*.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(128, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])
    pos = torch.arange(ids.shape[1])[None]
    logits = []
    for path in (plain, with_mtp):
        model = load_model(path, "cpu", "float32").model
        with torch.inference_mode():
            model.setup_cache(1, 64, torch.float32, "cpu")
            logits.append(model(ids, pos, pos, causal_mask(pos, 8)))
    assert torch.equal(logits[0], logits[1])
    assert parameters(with_mtp).total == parameters(plain).total == sum(p.numel() for p in model.parameters())
