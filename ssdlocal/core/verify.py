"""Pure lossless verification of speculated tokens: tensors in, Verdict out.

Implements the speculative-sampling accept/reject rule (accept x with probability
min(1, p(x)/q(x)), bonus from norm(max(p - q, 0)) at the first rejection, or from p
after the last draft). `verify_logits` is the one entry every mode uses: at temperature 0
it takes the target's argmax path (what `verify` does with one-hot p, without building
p or drawing random numbers), otherwise p from `logits_to_probs` and `verify`. Runs on
whatever device the tensors live on (moves between devices never make the host wait:
non_blocking). No state, no I/O, inputs are never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs, sample

# A residual with less mass than this is numerical noise (p == q up to rounding);
# the bonus is then drawn from p, which differs from the exact rule by < this mass.
RESIDUAL_EPS = 1e-6


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification round for every row of the batch."""

    n_accepted: Tensor  # [B] long, 0..n_draft[b]
    bonus: Tensor  # [B] long: the token the target emits after the accepted prefix


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [..., V] with every token `allowed` [..., V] (bool) forbids at -inf: a copy.

    Under a grammar the target's p at a position is softmax over the allowed tokens only
    (then temperature, top-k and top-p, as everywhere); `verify_logits` of masked logits
    is therefore verification against the constrained distribution."""
    return logits.masked_fill(~allowed, float("-inf"))  # [..., V]


def point_mass(tokens: Tensor, vocab_size: int) -> Tensor:
    """tokens [B, K] long -> one-hot proposals q [B, K, V] float32."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float32)  # [B, K, V]


def verify(
    p: Tensor,
    draft_tokens: Tensor,
    q: Tensor | None,
    generator: torch.Generator | None,
    n_draft: Tensor | None = None,
) -> Verdict:
    """Accept a prefix of each row's drafts and pick the bonus token, losslessly.

    p: [B, K+1, V] target probabilities (temperature/top-k/top-p already applied).
    draft_tokens: [B, K] long; entries at positions >= n_draft[b] are ignored.
    q: [B, K, V] the distributions the drafts were sampled from, or None for point-mass
       proposals (a deterministic drafter such as n-gram).
    n_draft: [B] long, the number of real drafts per row (0..K); None means K.
    Draws B*K uniforms for acceptance, then B for the bonus, from `generator`.
    """
    batch, k_plus_1, vocab_size = p.shape
    k = k_plus_1 - 1
    if draft_tokens.shape != (batch, k):
        raise ValueError(f"draft_tokens shape {tuple(draft_tokens.shape)} != {(batch, k)}")
    if q is not None and q.shape != (batch, k, vocab_size):
        raise ValueError(f"q shape {tuple(q.shape)} != {(batch, k, vocab_size)}")
    device = p.device
    p = p.to(torch.float32)  # [B, K+1, V] (a copy if the dtype differs; never written)
    rows = torch.arange(batch, device=device)  # [B]
    if n_draft is None:
        n_draft = torch.full((batch,), k, dtype=torch.long, device=device)  # [B]
    n_draft = n_draft.to(device=device, dtype=torch.long, non_blocking=True).clamp(0, k)  # [B]

    # --- accept / reject each draft position -------------------------------------
    positions = torch.arange(k, device=device)  # [K]
    real = positions.unsqueeze(0) < n_draft.unsqueeze(1)  # [B, K]
    tokens = torch.where(real, draft_tokens.to(device, non_blocking=True), 0)  # [B, K] padding -> token 0
    p_draft = p[:, :k].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, K] p(x_i)
    if q is None:
        q_draft = torch.ones_like(p_draft)  # [B, K] point mass: q(x_i) = 1
    else:
        q = q.to(device=device, dtype=torch.float32, non_blocking=True)  # [B, K, V]
        q_draft = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, K] q(x_i)
    rand_device = generator.device if generator is not None else device
    u = torch.rand((batch, k), generator=generator, device=rand_device).to(device, non_blocking=True)  # [B, K]
    # u < p/q written without division: q(x) == 0 with p(x) > 0 accepts, 0/0 rejects.
    accept = (u * q_draft < p_draft) & real  # [B, K]
    n_accepted = torch.cumprod(accept.to(torch.long), dim=-1).sum(-1)  # [B]

    # --- bonus token ---------------------------------------------------------------
    p_next = p[rows, n_accepted]  # [B, V] target distribution after the accepted prefix
    rejected = n_accepted < n_draft  # [B]
    if k > 0:
        at = n_accepted.clamp(max=k - 1)  # [B] the rejected position (where rejected)
        if q is None:
            rejected_token = tokens[rows, at]  # [B]
            q_at = point_mass(rejected_token, vocab_size)  # [B, V]
            # p - p(x) * onehot(x) is p with x zeroed, i.e. max(p - onehot(x), 0).
        else:
            q_at = q[rows, at]  # [B, V]
        residual = (p_next - q_at).clamp_min(0.0)  # [B, V] max(p_j - q_j, 0)
        residual_mass = residual.sum(-1, keepdim=True)  # [B, 1]
        use_residual = rejected.unsqueeze(-1) & (residual_mass > RESIDUAL_EPS)  # [B, 1]
        normalised = residual / residual_mass.clamp_min(1e-30)  # [B, V]
        dist = torch.where(use_residual, normalised, p_next)  # [B, V]
    else:
        dist = p_next  # [B, V]
    bonus = sample(dist, generator)  # [B]
    return Verdict(n_accepted=n_accepted, bonus=bonus)


def verify_logits(
    logits: Tensor,
    draft_tokens: Tensor,
    q: Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    n_draft: Tensor | None = None,
) -> Verdict:
    """`verify` from the target's raw logits [B, K+1, V] (K may be 0: plain decoding).

    Greedy: draft i is accepted iff it equals the target's argmax there and every earlier
    draft was accepted; the bonus is the argmax after the accepted prefix. That is exactly
    `verify` with one-hot p (the residual of a one-hot p is the same one-hot), and it
    draws nothing from `generator`. Otherwise p = logits_to_probs(logits) and `verify`.
    """
    if not params.greedy:
        return verify(logits_to_probs(logits, params), draft_tokens, q, generator, n_draft)
    batch, k_plus_1, _ = logits.shape
    k = k_plus_1 - 1
    best = torch.argmax(logits, dim=-1)  # [B, K+1]
    if k == 0:  # plain decoding: nothing to accept
        return Verdict(n_accepted=torch.zeros_like(best[:, 0]), bonus=best[:, 0])
    if n_draft is None:
        n_draft = torch.full((batch,), k, dtype=torch.long, device=logits.device)  # [B]
    real = torch.arange(k, device=logits.device)[None, :] < n_draft[:, None]  # [B, K]
    match = (best[:, :k] == draft_tokens) & real  # [B, K]
    n_accepted = torch.cumprod(match.to(torch.long), dim=-1).sum(-1)  # [B]
    bonus = best.gather(1, n_accepted[:, None]).squeeze(1)  # [B]
    return Verdict(n_accepted=n_accepted, bonus=bonus)


def verify_groups(
    logits: Tensor,
    draft_tokens: Tensor,
    q: Tensor | None,
    groups,
    n_draft: Tensor | None = None,
) -> Verdict:
    """`verify_logits` for a batch whose rows sample differently.

    `groups`: (rows, params, generator) per group of rows with equal sampling settings;
    `rows` a [G] long index tensor on the logits' device, or None for "every row" (then
    it must be the only group). Each group is verified on its own rows with its own
    params and generator, and the verdicts are scattered back: row b's verdict is
    exactly what verify_logits gives its group's rows, whatever the other groups are.
    """
    if len(groups) == 1 and groups[0][0] is None:
        _, params, generator = groups[0]
        return verify_logits(logits, draft_tokens, q, params, generator, n_draft)
    batch = logits.shape[0]
    n_accepted = torch.zeros(batch, dtype=torch.long, device=logits.device)  # [B]
    bonus = torch.zeros(batch, dtype=torch.long, device=logits.device)  # [B]
    for rows, params, generator in groups:
        part = verify_logits(
            logits[rows],
            draft_tokens[rows],
            None if q is None else q[rows],
            params,
            generator,
            None if n_draft is None else n_draft[rows],
        )
        n_accepted[rows] = part.n_accepted
        bonus[rows] = part.bonus
    return Verdict(n_accepted=n_accepted, bonus=bonus)
