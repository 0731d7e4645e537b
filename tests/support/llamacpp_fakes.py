"""Fixtures for the llama.cpp backend without the compiled library: the tiny llama
tokenizer, a FakeLlamaLib patched into the backend (`fake`), and ShapedLib (`shaped`),
the fake with llama.cpp's CPU kernel families in miniature. Test modules import the
fixtures they use from here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.fake_llamalib import FakeLlamaLib

from ssdlocal.backends.llamacpp import loader as gguf_loader
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
PROMPTS = ["hello world, def foo(x):", "the cat", "Once upon a time there was a little model"]


@pytest.fixture(scope="module")
def tok_dir(tiny_dir) -> Path:
    return tiny_dir["llama"]


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def vocab(tok_dir) -> int:
    return json.loads((tok_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture
def fake(monkeypatch, tokenizer, vocab, tmp_path):
    """Patch the backend to use FakeLlamaLib; returns (lib, target.gguf, draft.gguf)."""
    lib = FakeLlamaLib(vocab, tokenizer)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.lib.LlamaLib", lambda verbose=False: lib)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: False)  # no probe
    monkeypatch.setattr(gguf_loader, "gguf_tokenizer", lambda path: tokenizer)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.gguf_tokenizer", lambda path: tokenizer)
    paths = []
    for name in ("target.gguf", "draft.gguf"):
        p = tmp_path / name
        p.write_bytes(b"GGUF" + b"\0" * 60)
        paths.append(str(p))
    return lib, paths[0], paths[1]


def run(engine: Engine, prompts, spec=None, params=GREEDY):
    """(tokens per prompt, the call's stats)."""
    done = next(ev for ev in engine.generate(prompts, params, spec=spec) if isinstance(ev, DoneEvent))
    return [list(o.token_ids) for o in done.outputs], done.stats


class ShapedLib(FakeLlamaLib):
    """Logits shifted by the call's kernel family: 1 token, 2-3, 4 and more (as the float32
    query of a lone token and the matrix-matrix kernel of repacked weights differ)."""

    def __init__(self, vocab: int, tokenizer=None) -> None:
        super().__init__(vocab, tokenizer, max_seq=64)
        self.shift = np.random.default_rng(5).standard_normal((3, vocab)).astype(np.float32)
        self.widths: list[tuple[int, list[int]]] = []  # (context id, seqs) of every call

    def decode(self, ctx, tokens, positions, seqs, want, n_vocab):
        out = super().decode(ctx, tokens, positions, seqs, want, n_vocab)
        self.widths.append((id(ctx), list(seqs)))
        family = 0 if len(tokens) == 1 else 1 if len(tokens) < 4 else 2
        return out + self.shift[family]


@pytest.fixture
def shaped(fake, monkeypatch, vocab, tokenizer):
    """ShapedLib patched into the backend; returns (lib, target.gguf, draft.gguf)."""
    lib = ShapedLib(vocab, tokenizer)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.lib.LlamaLib", lambda verbose=False: lib)
    _old, target, draft = fake
    return lib, target, draft
