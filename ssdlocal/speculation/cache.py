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
from ssdlocal.core.hostsync import detached_site
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


def bonus_candidates(logits: torch.Tensor, drafted: int | None, fan_out: int, params: SamplingParams) -> list[int]:
    """Top-`fan_out` tokens of the draft's distribution at one position, excluding `drafted`.

    logits: [V] draft logits at the position where the bonus would be sampled.
    drafted: the token the draft speculated there (a rejected token has zero residual
    mass, so it can never be the bonus), or None at the all-accepted position.
    Ranking uses the warped draft distribution for sampling and raw logits for greedy.
    """
    return bonus_candidates_batch(logits[None], [drafted], [fan_out], params)[0]


def bonus_candidates_batch(
    logits: torch.Tensor, drafted: list[int | None], fan_outs: list[int], params: SamplingParams, site=None
) -> list[list[int]]:
    """`bonus_candidates` for N positions at once: one top-k and one host read (through
    `site`, a core.hostsync.Site; default: one nobody reads) for every row and accepted
    length of a round. logits [N, V]; drafted[i] and fan_outs[i] as in `bonus_candidates`."""
    if not fan_outs or max(fan_outs) <= 0:
        return [[] for _ in fan_outs]
    site = site or detached_site("worker")
    marks = site.upload([-1 if d is None else d for d in drafted], logits.device)  # [N]
    top = site.read(bonus_candidates_device(logits, marks, max(fan_outs), params))  # [N, C]
    return [row[: candidate_count(f, d, logits.shape[-1])] for row, d, f in zip(top, drafted, fan_outs)]


def bonus_candidates_device(
    logits: torch.Tensor, drafted: torch.Tensor, width: int, params: SamplingParams
) -> torch.Tensor:
    """Every position's bonus candidates, kept on the logits' device (no host read).

    logits [N, V]; drafted [N] long on the same device, the token drafted at each position
    or -1 at an all-accepted one. Returns [N, min(width, V)]: row i holds the top tokens of
    position i, best first, with drafted[i] moved out (kept entries first, order kept);
    its first `candidate_count(f, drafted, V)` entries equal `bonus_candidates(logits[i],
    drafted[i], f, params)` for every f <= width. Ranking as in `bonus_candidates`."""
    if width <= 0:
        return torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    score = logits.float() if params.greedy else logits_to_probs(logits.float(), params)  # [N, V]
    take = min(width + 1, score.shape[-1])
    top = torch.topk(score, take, dim=-1).indices  # [N, take]
    dropped = (top == drafted[:, None]).to(torch.uint8)  # [N, take] 1 where the drafted token is
    order = torch.argsort(dropped, dim=-1, stable=True)  # kept entries first, in rank order
    return top.gather(-1, order)[:, : min(width, score.shape[-1])]


def candidate_count(fan_out: int, drafted: int | None, vocab: int) -> int:
    """How many bonus candidates a position with `fan_out` has (host-known: no read):
    the fan-out, capped by the vocabulary less the drafted token."""
    return max(0, min(fan_out, vocab - (drafted is not None)))
