"""Fixtures shared by several test modules (conftest.py makes them visible to every test):
a tiny Qwen2 GGUF file, fake PyPI wheels with a fake pip, and a fake hub."""

from __future__ import annotations

import json

import pytest

from support.hub import PAIR_TOML, FakeHub
from support.wheels import fake_asset, pip_calls  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, transformers model) of a random 2-layer Qwen2 written as an F32 GGUF."""
    from support.tiny_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2-f32.gguf"
    model = write_tiny_gguf(path)
    return path, model


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    """A fake hub with `fake-pair` registered through SSDLOCAL_PAIRS_PATH."""
    import huggingface_hub

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    fake = FakeHub(tmp_path / "remote")
    weights = bytes(range(256)) * 64  # 16 KiB
    for repo in ("org/target", "org/draft"):
        fake.add_repo(
            repo,
            {
                "config.json": json.dumps({"model_type": "llama"}).encode(),
                "model.safetensors": weights,
                "tokenizer.json": b"{}",
                "original/consolidated.00.pth": b"x" * 100,
                "pytorch_model.bin": b"y" * 100,
            },
        )
    fake.add_repo("org/target-gguf", {"target-Q4_K_M.gguf": b"GGUF" + weights})
    fake.add_repo("org/draft-gguf", {"draft-Q8_0.gguf": b"GGUF" + weights[:100]})
    pair_file = tmp_path / "pairs" / "fake.toml"
    pair_file.parent.mkdir()
    pair_file.write_text(PAIR_TOML)
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(pair_file.parent))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "model_info", fake.model_info)
    return fake
