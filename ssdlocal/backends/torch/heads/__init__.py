"""Draft heads: small networks that draft from the target's hidden states, loaded beside the
target and sharing its token embeddings: EAGLE-3 (eagle3.py, with its own one-layer KV
cache: runner.py) and Gemma 4's MTP assistant (gemma4_assistant.py, which attends over the
target's own cache: assistant_runner.py). What a head drafts is verified like any draft,
so a head changes speed, never the output. `load_head` (Backend.load_head) goes from a
head's kind (weights.formats.archs.HEADS) to its loaded runner through `LOADERS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ssdlocal.backends.base import HeadInputs


def _eagle3(path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    from ssdlocal.backends.torch.heads.eagle3 import load_eagle3
    from ssdlocal.backends.torch.heads.runner import HeadRunner

    head = load_eagle3(path, shared.embeddings, shared.layers, target_vocab, device, shared.dtype)
    return HeadRunner(head, device, shared.dtype)


def _gemma4_assistant(path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    from ssdlocal.backends.torch.heads.assistant_runner import AssistantRunner
    from ssdlocal.backends.torch.heads.gemma4_assistant import load_assistant

    head = load_assistant(path, shared, target_vocab, device, shared.dtype)
    return AssistantRunner(head, shared, device)


# head kind -> (head directory, what the target shares, its vocabulary, device) -> its runner
LOADERS: dict[str, Callable[[str, HeadInputs, int, Any], Any]] = {
    "eagle3": _eagle3,
    "gemma4_assistant": _gemma4_assistant,
}


def load_head(kind: str, path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    """The runner of the `kind` head in directory `path` (a key of weights.formats.archs.HEADS),
    loaded on `device` beside a target that shares `shared` with it."""
    if kind not in LOADERS:
        raise ValueError(f"no loader for a {kind} head")  # a caller bug: kinds come from HEADS
    return LOADERS[kind](path, shared, target_vocab, device)
