"""A server's captured steps, taken at its start instead of in the middle of answers.

Joins and leaves change a server's batch size at every re-seat; the torch runners keep
their KV caches and graphs across that (backends/torch/shapes.py: rows padded to a
bucket), so the shapes a round takes are known before the first request: every batch
bucket up to the server's largest batch, the target's 1-token and K+1-token steps, and a
draft model's 1-token steps and catch-up widths 1 and 2 (SD in this process), at the first
span bucket. A longer span is captured when rows first reach it, once per server; the SSD
worker (a process of its own) captures its steps when it first takes them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ssdlocal.core.config import Mode, SpecConfig

if TYPE_CHECKING:
    from ssdlocal.engine.parts import EngineParts

log = logging.getLogger(__name__)

CATCH_UP_WIDTHS = (1, 2, 4)  # a draft model's catch-up: the bonus, or the bonus and the last draft, or a few more


def warm_up(parts: EngineParts, spec: SpecConfig, max_batch: int) -> int:
    """Capture the steps a server of `max_batch` rows in `spec`'s (resolved) mode takes on
    its target and, for SD, its draft model (when loaded here); returns the graphs captured."""
    k = spec.k if spec.mode is not Mode.AR else 0
    widths = (1,) if k == 0 else (1, k + 1)
    captured = parts.target.warm_up(max_batch, widths)
    draft = parts.drafts.runner if spec.mode is Mode.SD and spec.draft.model is not None else None
    if draft is not None:
        captured += draft.warm_up(max_batch, (1,), CATCH_UP_WIDTHS)
    if captured:
        log.info("captured %d step graph(s) for up to %d rows before serving", captured, max_batch)
    return captured
