"""Log-probabilities of emitted tokens and their top alternatives, from logits verification holds.

The distribution is the target's own: log_softmax of its logits at temperature 1, before
temperature, top-k and top-p (at temperature 0 those would make every emitted token's
log-probability 0), and after a grammar's mask when the row has one (a forbidden token
cannot be emitted; the allowed ones are renormalised). Pure tensor math.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.core.config import MAX_TOP_LOGPROBS as MAX_TOP  # noqa: F401 - the bound, here too
from ssdlocal.core.events import TokenLogprob

_NEG_INF = float("-inf")


def token_logprobs(logits: Tensor, chosen: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, T, V], chosen [B, T] long -> (logprob of chosen [B, T], top ids [B, T, N],
    top logprobs [B, T, N]), N = min(top, V), all float32 / long on logits' device."""
    lsm = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, T, V]
    picked = lsm.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)  # [B, T]
    n = min(top, lsm.shape[-1])
    values, ids = torch.topk(lsm, n, dim=-1) if n else (lsm[..., :0], chosen[..., None][..., :0])  # [B, T, N]
    return picked, ids, values


def to_host(p: list, i: list, v: list, chosen: list[list[int]]) -> list[tuple[TokenLogprob, ...]]:
    """`token_logprobs`' three tensors read to host lists (p, i, v) -> per row, one
    TokenLogprob for each of `chosen[b]` (its first len(chosen[b]) positions); alternatives
    a grammar forbids (log-probability -inf) are left out."""
    out = []
    for b, tokens in enumerate(chosen):
        out.append(
            tuple(
                TokenLogprob(tok, p[b][t], tuple((a, x) for a, x in zip(i[b][t], v[b][t]) if x != _NEG_INF))
                for t, tok in enumerate(tokens)
            )
        )
    return out
