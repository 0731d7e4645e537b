"""Logits -> probabilities (temperature, top-k, top-p), seeded sampling, Saguaro q'.

Pure tensor math. Every mode (AR / SD / SSD) turns target logits into `p` with
`logits_to_probs`, so top-k/top-p change `p` identically everywhere. Knows nothing
about models, caches or processes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.core.config import SamplingParams


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] (any float dtype) -> probs [..., V] float32.

    temperature 0: one-hot at `torch.argmax` (first index among ties).
    Otherwise softmax(logits / T), then top-k (keep the k most likely; 0 = off), then
    top-p (keep the smallest most-likely prefix with mass >= top_p, always at least the
    top token), then renormalise.
    """
    vocab_size = logits.shape[-1]
    if params.greedy:
        top = torch.argmax(logits, dim=-1)  # [...]
        return torch.nn.functional.one_hot(top, vocab_size).to(torch.float32)  # [..., V]

    probs = torch.softmax(logits.to(torch.float32) / params.temperature, dim=-1)  # [..., V]
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    if top_k == 0 and params.top_p >= 1.0:
        return probs

    # One stable descending sort serves both filters; ranks are positions in it.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [..., V] x2
    keep_sorted = torch.ones_like(sorted_probs, dtype=torch.bool)  # [..., V]
    if top_k:
        keep_sorted[..., top_k:] = False
        sorted_probs = sorted_probs * keep_sorted  # [..., V]
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)  # [..., V]
    if params.top_p < 1.0:
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V] exclusive
        keep_sorted &= mass_before < params.top_p  # [..., V]; rank 0 always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # [..., V]
    probs = probs * keep  # [..., V]
    return probs / probs.sum(-1, keepdim=True)  # [..., V]


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs [N, V] (or [..., V]) -> tokens [N] long, by inverse CDF on seeded uniforms.

    Draws exactly one uniform per row from `generator`, whatever the rows hold, so the
    random stream advances identically in every mode. One-hot rows return their index.
    Never returns a zero-probability token.
    """
    lead_shape = probs.shape[:-1]
    flat = probs.reshape(-1, probs.shape[-1]).to(torch.float32)  # [N, V]
    n_rows, vocab_size = flat.shape
    rand_device = generator.device if generator is not None else flat.device
    u = torch.rand(n_rows, generator=generator, device=rand_device).to(flat.device, non_blocking=True)  # [N]
    cdf = torch.cumsum(flat, dim=-1)  # [N, V]
    target = u * cdf[:, -1]  # [N] scaled so rows need not sum exactly to 1
    tokens = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)  # [N]
    # Rounding can push `target` onto the last cdf value: fall back to the last
    # token with positive probability, never a zero-probability one.
    positive = flat > 0  # [N, V]
    last_positive = vocab_size - 1 - torch.argmax(positive.flip(-1).to(torch.uint8), dim=-1)  # [N]
    tokens = torch.minimum(tokens, last_positive)  # [N]
    max_prob, argmax = flat.max(dim=-1)  # [N] x2
    tokens = torch.where(max_prob == 1.0, argmax, tokens)  # [N] one-hot rows exact
    return tokens.reshape(lead_shape)


def saguaro_probs(q: Tensor, fan_out: int, c: float) -> Tensor:
    """Saguaro sampling: q [..., V] -> q' [..., V] float32.

    The top-`fan_out` probabilities of each row are multiplied by `c` in (0, 1] and the
    row is renormalised. fan_out 0 or c == 1 returns q unchanged (as float32).
    """
    q = q.to(torch.float32)
    if fan_out <= 0 or c >= 1.0:
        return q
    if not c > 0.0:
        raise ValueError(f"saguaro c must be in (0, 1], got {c}")
    fan_out = min(fan_out, q.shape[-1])
    top_idx = torch.topk(q, fan_out, dim=-1).indices  # [..., F]
    scale = torch.ones_like(q).scatter(-1, top_idx, c)  # [..., V]
    scaled = q * scale  # [..., V]
    return scaled / scaled.sum(-1, keepdim=True)  # [..., V]
