"""The Drafter protocol and the Proposal it returns; what the engine expects of a drafter.

A drafter proposes up to K tokens per active row and says which distribution each
token was drawn from (`q`), so verification stays lossless. Proposals live on the
target's device. A drafter must not know about the target model or the engine's
stopping rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round, where the target verifies them.

    drafts: [B, K] long on the target's device; entries past n_draft[b] are padding.
    n_draft: [B] long on the target's device, real drafts per row (0 for idle rows).
    q: [B, K, V] float32 on the target's device, the distributions the drafts were drawn
       from, or None when every draft is a deterministic choice (point mass: greedy or
       n-gram).
    tokens: the same drafts as host lists when the drafter has them (else the engine
       reads them back with the verdict).
    cache_hit[b]: SSD only, whether row b was served from the speculation cache.
    backup: SSD only, which backup produced the missed rows ("jit", "ngram", "none").
    draft_busy_s: SSD only, the worker's compute time since its previous proposal
       (pre-speculation + serving), to compare with the target's verify time.
    """

    drafts: torch.Tensor
    n_draft: torch.Tensor
    q: torch.Tensor | None = None
    tokens: list[list[int]] | None = None
    cache_hit: list[bool] | None = None
    backup: str | None = None
    draft_busy_s: float | None = None

    @classmethod
    def from_lists(cls, tokens: Sequence[Sequence[int]], k: int, device, **fields) -> Proposal:
        """Host token lists (0..K per row) -> drafts and n_draft on `device`."""
        padded = [list(t) + [0] * (k - len(t)) for t in tokens]
        drafts = torch.tensor(padded, dtype=torch.long).reshape(len(padded), k)  # [B, K]
        n_draft = torch.tensor([len(t) for t in tokens], dtype=torch.long)  # [B]
        return cls(drafts.to(device), n_draft.to(device), tokens=[list(t) for t in tokens], **fields)


class Drafter(Protocol):
    """What the engine calls, in this order: start, then (propose, observe) per round."""

    k: int

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        """Prepare for a new batch whose rows currently hold `sequences` (prompt + first token)."""

    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        """Draft up to K tokens for every active row continuing `sequences[b]`."""

    def observe(
        self,
        sequences: Sequence[Sequence[int]],
        n_accepted: Sequence[int],
        bonus: Sequence[int],
        active: Sequence[bool],
        verdict=None,
    ) -> None:
        """The round's outcome: rows now hold `sequences`; `active[b]` is False once row b
        has finished (it will never be proposed for again). `verdict` (core.verify.Verdict)
        holds the same n_accepted and bonus on the target's device."""

    def close(self) -> None:
        """Release processes and memory. Idempotent."""


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad (with -inf) or cut the last dim of draft logits [..., V_d] to the target's V."""
    v_draft = logits.shape[-1]
    if v_draft == vocab_size:
        return logits
    if v_draft > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v_draft), float("-inf"))
    return torch.cat([logits, pad], dim=-1)  # [..., V]

