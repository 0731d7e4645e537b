"""Shared pytest setup: makes tests/ importable and builds the tiny checkpoints once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints sharing one tokenizer: llama, qwen2, qwen3, llama3_rope,
    draft_llama / draft_qwen2 (noisy copies of the targets), small_llama (1 layer)."""
    from tiny_models import make_tiny_suite

    return make_tiny_suite(tmp_path_factory.mktemp("tiny_models"))
