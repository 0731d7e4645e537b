"""Speculation cache: pre-computed next-round drafts keyed by the verification outcome.

Key = (row, n_accepted, bonus_token) (docs/architecture.md §1). A value is a Branch: the K
draft tokens decoded after that outcome, their draft logits (for q / q' and for the
next round's candidates) and where the branch's KV lives. Pure container; the draft
worker fills it while the target verifies and empties it every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs


@dataclass(frozen=True)
class Branch:
    """One pre-speculated continuation for outcome (row, n_accepted, bonus)."""

    row: int
    n_accepted: int
    bonus: int
    tokens: tuple[int, ...]  # e_1..e_K drafted after the bonus
    logits: torch.Tensor  # [K, V] draft logits predicting e_1..e_K (vocab aligned to target)
    q: torch.Tensor | None  # [K, V] the q' each e_j was sampled from (None when greedy)
    slot_start: int  # first scratch slot: holds the bonus, then e_1..e_{K-1}


CacheKey = tuple[int, int, int]


class SpeculationCache:
    """dict-like store of Branches for the current round only."""

    def __init__(self) -> None:
        self._branches: dict[CacheKey, Branch] = {}

    def put(self, branch: Branch) -> None:
        self._branches[(branch.row, branch.n_accepted, branch.bonus)] = branch

    def get(self, row: int, n_accepted: int, bonus: int) -> Branch | None:
        return self._branches.get((row, n_accepted, bonus))

    def clear(self) -> None:
        self._branches.clear()

    def __len__(self) -> int:
        return len(self._branches)

    def keys(self) -> list[CacheKey]:
        return list(self._branches)


def bonus_candidates(
    logits: torch.Tensor, drafted: int | None, fan_out: int, params: SamplingParams
) -> list[int]:
    """Top-`fan_out` tokens of the draft's distribution at one position, excluding `drafted`.

    logits: [V] draft logits at the position where the bonus would be sampled.
    drafted: the token the draft speculated there (a rejected token has zero residual
    mass, so it can never be the bonus), or None at the all-accepted position.
    Ranking uses the warped draft distribution for sampling and raw logits for greedy.
    """
    if fan_out <= 0:
        return []
    score = logits.float() if params.greedy else logits_to_probs(logits.float(), params)  # [V]
    take = min(fan_out + (1 if drafted is not None else 0), score.shape[-1])
    top = torch.topk(score, take).indices.tolist()
    picked = [t for t in top if t != drafted]
    return picked[:fan_out]
