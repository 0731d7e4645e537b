"""Draft heads: small networks that draft from the target's hidden states (EAGLE-3), with
their own one-layer KV cache (runner.py). A head is loaded beside the target and shares its
token embeddings; what it drafts is verified like any draft, so a head changes speed, never
the output."""

from __future__ import annotations

from typing import Any

from ssdlocal.backends.base import HeadInputs


def load_head(kind: str, path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    """The runner of the `kind` head in directory `path` (a key of weights.formats.archs.HEADS),
    loaded on `device` beside a target that shares `shared` with it."""
    from ssdlocal.backends.torch.heads.eagle3 import load_eagle3
    from ssdlocal.backends.torch.heads.runner import HeadRunner

    if kind != "eagle3":
        raise ValueError(f"no loader for a {kind} head")  # a caller bug: kinds come from HEADS
    head = load_eagle3(path, shared.embeddings, shared.layers, target_vocab, device, shared.dtype)
    return HeadRunner(head, device, shared.dtype)
