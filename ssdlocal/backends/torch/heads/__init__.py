"""Draft heads: small networks that draft from the target's hidden states, loaded beside the
target and sharing its token embeddings: EAGLE-3 (eagle3.py, with its own one-layer KV
cache: runner.py), the MTP layer a Qwen3.5 checkpoint ships (mtp.py, on the same runner),
Gemma 4's MTP assistant (gemma4_assistant.py, which attends over the
target's own cache: assistant_runner.py), and DFlash block drafters (dflash.py, whose
runner dflash_runner.py drafts a whole block per forward). What a head drafts is verified like any draft,
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


def _mtp(path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    from ssdlocal.backends.torch.heads.mtp import load_mtp
    from ssdlocal.backends.torch.heads.runner import HeadRunner

    return HeadRunner(load_mtp(path, shared, target_vocab, device, shared.dtype), device, shared.dtype)


def _gemma4_assistant(path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    from ssdlocal.backends.torch.heads.assistant_runner import AssistantRunner
    from ssdlocal.backends.torch.heads.gemma4_assistant import load_assistant

    head = load_assistant(path, shared, target_vocab, device, shared.dtype)
    return AssistantRunner(head, shared, device)


def _dflash(path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    from ssdlocal.backends.torch.heads.dflash import load_dflash
    from ssdlocal.backends.torch.heads.dflash_runner import BlockRunner

    return BlockRunner(load_dflash(path, shared, target_vocab, device, shared.dtype), device, shared.dtype)


# head kind -> (head directory, what the target shares, its vocabulary, device) -> its runner
LOADERS: dict[str, Callable[[str, HeadInputs, int, Any], Any]] = {
    "eagle3": _eagle3,
    "mtp": _mtp,
    "gemma4_assistant": _gemma4_assistant,
    "dflash": _dflash,
}


def load_head(kind: str, path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    """The runner of the `kind` head in directory `path` (a key of weights.formats.archs.HEADS),
    loaded on `device` beside a target that shares `shared` with it."""
    if kind not in LOADERS:
        raise ValueError(f"no loader for a {kind} head")  # a caller bug: kinds come from HEADS
    return LOADERS[kind](path, shared, target_vocab, device)
