"""Draft heads: small networks that draft from the target's hidden states, loaded beside the
target and sharing its token embeddings: EAGLE-3 (eagle3.py, with its own one-layer KV
cache: runner.py) and Gemma 4's MTP assistant (gemma4_assistant.py, which attends over the
target's own cache: assistant_runner.py). What a head drafts is verified like any draft,
so a head changes speed, never the output. `load_runner` is the table from a head's kind
(weights.formats.archs.HEADS) to its loaded runner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _eagle3(path: Path, target, vocab: int):
    from ssdlocal.backends.torch.heads.eagle3 import load_eagle3
    from ssdlocal.backends.torch.heads.runner import HeadRunner

    shared = target.head_inputs()
    head = load_eagle3(path, shared.embeddings, shared.layers, vocab, target.device, shared.dtype)
    return HeadRunner(head, target.device, shared.dtype)


def _gemma4_assistant(path: Path, target, vocab: int):
    from ssdlocal.backends.torch.heads.assistant_runner import AssistantRunner
    from ssdlocal.backends.torch.heads.gemma4_assistant import load_assistant

    shared = target.head_inputs()
    head = load_assistant(path, shared, vocab, target.device, shared.dtype)
    return AssistantRunner(head, shared, target, shared.dtype)


# head kind -> (head directory, the target's Runner, the target's vocabulary) -> its runner
RUNNERS: dict[str, Callable] = {"eagle3": _eagle3, "gemma4_assistant": _gemma4_assistant}


def load_runner(kind: str, path: str | Path, target, vocab: int):
    """The runner of a `kind` head at `path` beside `target` (its device and dtype)."""
    return RUNNERS[kind](Path(path).expanduser(), target, vocab)
