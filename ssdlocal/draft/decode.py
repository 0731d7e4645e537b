"""The K-step draft decoder both model drafters share: K tokens per row on the draft's device.

`ModelDrafter` (SD) and the SSD speculator's just-in-time backup both need the same job
done: given the draft's logits after each row's newest token, draw d_1, feed it, draw
d_2, ... d_K. Everything stays on the draft's device (tokens, q, logits): no host round
trip between the K steps, one read-back at the end by whoever needs host lists.
Knows nothing about rounds, verification or processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ssdlocal.backends.base import Runner
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs, sample


@dataclass(frozen=True)
class Drafted:
    """K drafts per row, on the draft's device.

    tokens: [B, K] long.
    q: [B, K, V] float32, the distributions the drafts were drawn from (None when greedy).
    logits: [B, K, V] float32, the draft's logits each draft was drawn from (kept only when
        asked for: the SSD speculator reuses them as its predictions).
    """

    tokens: Tensor
    q: Tensor | None
    logits: Tensor | None


def align_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Pad (with -inf) or cut the last dim of draft logits [..., V_d] to the target's V."""
    v_draft = logits.shape[-1]
    if v_draft == vocab_size:
        return logits
    if v_draft > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v_draft), float("-inf"))
    return torch.cat([logits, pad], dim=-1)  # [..., V]


@dataclass(frozen=True)
class Drafting:
    """What K-step drafting draws with, for the decoder and every drafter built on it: the
    draft's runner, K (the most drafts a round asks for), the sampling settings and the
    target's vocabulary size (drafts' q are over it). `row_params` (default: `params` for
    every row): each row's sampling settings, so a batch whose rows sample differently
    draws each row from its own warp."""

    runner: Runner
    k: int
    params: SamplingParams
    target_vocab: int
    row_params: Sequence[SamplingParams] = ()


class DraftDecoder:
    """Draws K tokens per row with a draft Runner in step mode (`drafting`: Drafting).

    `probs(logits [B, V], j) -> q [B, V]`: the distribution draft j is drawn from (default:
    the sampling parameters' warp, i.e. what the target's p gets; the rows' own with
    `row_params`); unused when greedy.
    `allowed(j, previous) -> bool [B, V]` (optional): the tokens draft j may be, given the
    previous draft [B] (None at j = 0); the draft's logits are masked to them before q, so
    drafts follow a grammar and q is what they were drawn from.
    """

    def __init__(
        self, drafting: Drafting, generator: torch.Generator, probs: Callable[[Tensor, int], Tensor] | None = None
    ) -> None:
        self.runner = drafting.runner
        self.k = drafting.k  # a drafter may lower it for a round
        self.target_vocab = drafting.target_vocab
        self.generator = generator
        params = drafting.params
        self.probs = probs or (lambda logits, j: logits_to_probs(logits, params))
        self.allowed: Callable[[int, Tensor | None], Tensor] | None = None
        self.groups = _groups(drafting.row_params, self.runner.device) if probs is None else []  # [] or 2+ groups
        self.greedy = params.greedy if not self.groups else all(p.greedy for _, p in self.groups)

    @torch.inference_mode()
    def decode(self, first: Tensor, bound: int, keep_logits: bool = False) -> Drafted:
        """first [B, V_d]: the draft's logits after each row's newest token, which the
        runner holds, its lengths just past it. Draws d_1 from `first`, then feeds d_j and
        draws d_{j+1} (K-1 steps, lengths += 1 each). `bound`: a bound on every row's
        length + K (attention span). Rows nobody needs draw garbage, harmlessly."""
        tokens: list[Tensor] = []  # [B] per step
        qs: list[Tensor] = []  # [B, V] per step, none when greedy
        kept: list[Tensor] = []  # [B, V] per step, with keep_logits
        logits = align_vocab(first, self.target_vocab)  # [B, V]
        for j in range(self.k):
            if j > 0:
                step = self.runner.step(tokens[-1][:, None], bound)[:, 0]  # [B, V_d] (a static buffer)
                self.runner.advance(1)
                logits = align_vocab(step, self.target_vocab)  # [B, V]
            if self.allowed is not None:
                mask = self.allowed(j, tokens[-1] if j else None)  # [B, V] bool
                mask = mask if mask.device == logits.device else mask.to(logits.device)  # [B, V] bool
                logits = logits.masked_fill(~mask, float("-inf"))  # [B, V]
            if keep_logits:
                kept.append(logits.clone())  # the next step may overwrite the buffer
            token, q = self._draw(logits, j)
            tokens.append(token)
            if q is not None:
                qs.append(q)
        q_all = None if self.greedy else torch.stack(qs, dim=1)  # [B, K, V]
        return Drafted(torch.stack(tokens, dim=1), q_all, torch.stack(kept, dim=1) if keep_logits else None)

    @torch.inference_mode()
    def draw_block(self, block: Tensor) -> Drafted:
        """block [B, K, V_d]: a block drafter's logits for K positions at once -> d_j drawn
        from position j's own distribution (independent of the other draws; masked by
        `allowed` given d_{j-1} as in `decode`), with no runner steps."""
        tokens: list[Tensor] = []  # [B] per position
        qs: list[Tensor] = []  # [B, V] per position, none when greedy
        for j in range(block.shape[1]):
            logits = align_vocab(block[:, j], self.target_vocab)  # [B, V]
            if self.allowed is not None:
                mask = self.allowed(j, tokens[-1] if j else None)  # [B, V] bool
                logits = logits.masked_fill(~mask.to(logits.device), float("-inf"))  # [B, V]
            token, q = self._draw(logits, j)
            tokens.append(token)
            if q is not None:
                qs.append(q)
        q_all = None if self.greedy else torch.stack(qs, dim=1)  # [B, K, V]
        return Drafted(torch.stack(tokens, dim=1), q_all, None)

    def _draw(self, logits: Tensor, j: int) -> tuple[Tensor, Tensor | None]:
        """logits [B, V] -> (token [B], q [B, V] or None when greedy). Rows of other
        sampling settings (`row_params`) each get their own warp (greedy rows a one-hot
        q), and every row draws one uniform, as with one setting."""
        if self.greedy:
            return torch.argmax(logits, dim=-1), None  # [B]
        if not self.groups:
            q = self.probs(logits, j)  # [B, V]
        else:
            q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V]
            for index, params in self.groups:
                q[index] = logits_to_probs(logits[index], params)  # [G, V]
        return sample(q, self.generator), q


def _groups(row_params: Sequence[SamplingParams], device) -> list[tuple[Tensor, SamplingParams]]:
    """(rows [G] long on `device`, params) per warp (SamplingParams.warp) among `row_params`;
    [] when there are fewer than two."""
    found: dict[tuple, list[int]] = {}
    for b, p in enumerate(row_params):
        found.setdefault(p.warp, []).append(b)
    if len(found) < 2:
        return []
    return [(torch.tensor(rows, dtype=torch.long, device=device), row_params[rows[0]]) for rows in found.values()]
