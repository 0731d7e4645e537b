"""Gemma 4 GGUF files (llama.cpp's "gemma4", the dense text model without per-layer inputs
or shared KV) through the torch backend.

- the config llama.cpp reads from the file (weights/formats/gguf_config.py): the sliding
  layers' head size (transformers' reader keeps the default 256), which layers slide, both
  rotary tables (the global one proportional, its share of turning pairs read from
  `rope_freqs`), the soft-capping; what it does not implement is refused by name;
- (marker `llamacpp`) a tiny random GGUF (support/tiny_gguf_families.py: three sliding
  layers of head size 16 and a global one of 32, window 8, soft-capping 30) gives
  llama.cpp's logits at every position and its greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from support.gguf_compare import llamacpp_greedy, llamacpp_logits, torch_logits  # noqa: E402
from support.tiny_gguf_families import WINDOW, Sizes, layout_of, write_family_gguf  # noqa: E402

from ssdlocal.core.errors import UnsupportedArchitectureError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

IDS = [5, 17, 200, 3, 99, 12, 40, 41, 42, 43, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 60, 61, 62, 63]
# ggml's CPU GELU reads a float16 table (GGML_GELU_FP16: the input rounded to float16), we
# compute it exactly, as transformers does: measured up to 1.1e-3 on logits of about 1
GELU_CLOSE = 2e-3


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.getbasetemp() / "gemma4-cache"))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_family_gguf(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf", "gemma4")


def test_the_config_is_what_llamacpp_reads(path):
    from ssdlocal.weights.formats.convert import ensure_converted

    s = Sizes()
    config = json.loads((ensure_converted(path, dtype="float32") / "config.json").read_text())
    assert config["head_dim"] == s.head_dim and config["hidden_size_per_layer_input"] == 0
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["sliding_window"] == WINDOW and config["final_logit_softcapping"] == 30.0
    assert config["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    from ssdlocal.backends.torch.loader import load_model

    args = load_model(ensure_converted(path, dtype="float32"), "cpu", "float32").args
    assert (args.head_dim, args.global_head_dim) == (s.head_dim, 2 * s.head_dim)


@pytest.mark.parametrize(
    ("keys", "drop", "named"),
    [
        ({"embedding_length_per_layer_input": 8}, None, "embedding_length_per_layer_input=8"),
        ({"attention.shared_kv_layers": 1}, None, "attention.shared_kv_layers=1"),
        ({"rope.dimension_count_swa": 8}, None, "rope.dimension_count_swa=8"),
        ({}, "blk.3.attn_v.weight", "keys as values"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(tmp_path, monkeypatch, keys, drop, named):
    import support.tiny_gguf_families as families

    from ssdlocal.weights.formats.gguf import GGUFHeader
    from ssdlocal.weights.formats.gguf_tensors import gguf_config_fields
    from ssdlocal.weights.formats.archs import architecture

    def changed(sizes, vocab):
        layout = families.gemma4(sizes, vocab)
        layout.keys.update(keys)
        layout.tensors.pop(drop, None)
        return layout

    monkeypatch.setitem(families.BUILDERS, "gemma4", changed)
    assert layout_of("gemma4").keys.items() >= keys.items()
    header = GGUFHeader.read(write_family_gguf(tmp_path / "x.gguf", "gemma4"))
    with pytest.raises(UnsupportedArchitectureError, match=named):
        gguf_config_fields(header, architecture("gemma4"))


@pytest.mark.llamacpp
def test_logits_and_greedy_tokens_are_llamacpps(path, record_property):
    """24 tokens (three sliding windows): every position's logits are llama.cpp's (within
    its float16 GELU table), and its greedy tokens over 48 steps are ours."""
    assert len(IDS) > 2 * WINDOW
    want, got = llamacpp_logits(path, IDS), torch_logits(path, IDS)
    diff = float(np.abs(got - want).max())
    record_property("max_logit_diff", diff)
    assert diff <= GELU_CLOSE
    steps, prompt = 48, IDS[:6]
    tokens = llamacpp_greedy(path, prompt, steps)
    picks = torch_logits(path, prompt + tokens[:-1]).argmax(-1)  # [T]: each position's greedy pick
    assert picks[len(prompt) - 1 :].tolist() == tokens  # so our greedy decoding is llama.cpp's
