"""Losslessness of verify(): chi-square tests on tiny vocabularies, greedy exactness.

Every statistical assertion fails only when its p-value is < 1e-4 (see support/stats.py),
so a correct verify fails fewer than 1 in 10^4 runs per assertion; seeds are fixed so
CI is deterministic. Large batches B replace Python loops over trials.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats
from support.stats import (
    ALPHA,
    assert_distribution,
    assert_not_distribution,
    joint_index,
)

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs, saguaro_probs, sample
from ssdlocal.core.verify import Verdict, point_mass, verify

B = 40_000  # trials per statistical test

# Hand-made distributions on V = 6.
P0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
P2 = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.20, 0.20])
P3 = torch.tensor([0.10, 0.40, 0.10, 0.10, 0.10, 0.20])
Q_NEAR = torch.tensor([0.28, 0.27, 0.18, 0.14, 0.08, 0.05])  # close to P0: mostly accepts
Q_FAR = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.30, 0.50])  # far from P0: mostly rejects


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(q_rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """q_rows [K, V] -> drafts [B, K], each column sampled from its q (independent of sample())."""
    return torch.stack(
        [torch.multinomial(q_rows[i], B, replacement=True, generator=gen) for i in range(len(q_rows))],
        dim=1,
    )


def _single_round(p_rows, q_rows, seed, verify_fn=verify, n_draft=None):
    """Position-only p [K+1, V], q [K, V]: draft from q, verify. Returns drafts, verdict."""
    gen = _gen(seed)
    drafts = _draw(q_rows, gen)  # [B, K]
    p = p_rows.expand(B, -1, -1)  # [B, K+1, V]
    q = q_rows.expand(B, -1, -1)  # [B, K, V]
    return drafts, verify_fn(p, drafts, q, gen, n_draft)


def _first_token(drafts, verdict):
    return torch.where(verdict.n_accepted > 0, drafts[:, 0], verdict.bonus)


def _residual(p, q):
    r = (p - q).clamp_min(0)
    return r / r.sum()


# --- deliberately broken verifiers (must be caught by the same harness) -------------


def verify_bonus_from_p(p, drafts, q, gen, n_draft=None) -> Verdict:
    """BROKEN: on rejection samples the bonus from p instead of the residual."""
    v = verify(p, drafts, q, gen, n_draft)
    p_next = p[torch.arange(p.shape[0]), v.n_accepted]  # [B, V]
    return Verdict(v.n_accepted, sample(p_next, gen))


def verify_argmax_accept(p, drafts, q, gen, n_draft=None) -> Verdict:
    """BROKEN: accepts a draft iff it equals argmax p, even at T > 0."""
    k = drafts.shape[1]
    accept = drafts == p[:, :k].argmax(-1)  # [B, K]
    n_acc = torch.cumprod(accept.long(), -1).sum(-1)  # [B]
    p_next = p[torch.arange(p.shape[0]), n_acc]  # [B, V]
    return Verdict(n_acc, sample(p_next, gen))


# --- single round: accept path, reject path, all-accepted bonus -----------------------


def test_accept_path_first_token_and_acceptance_rate():
    p_rows = torch.stack([P0, P1, P2, P3])
    q_rows = torch.stack([Q_NEAR, P1, P2])
    drafts, v = _single_round(p_rows, q_rows, seed=1)
    assert_distribution(_first_token(drafts, v), P0, what="first token (accept path)")
    # first draft accepted with probability sum_x min(p, q)
    accept_prob = float(torch.minimum(P0, Q_NEAR).sum())
    accepted = int((v.n_accepted > 0).sum())
    assert stats.binomtest(accepted, B, accept_prob).pvalue >= ALPHA
    assert accepted > 0.9 * B


def test_reject_path_first_token_and_residual():
    p_rows = torch.stack([P0, P1, P2])
    q_rows = torch.stack([Q_FAR, P1])
    drafts, v = _single_round(p_rows, q_rows, seed=2)
    assert_distribution(_first_token(drafts, v), P0, what="first token (reject path)")
    rejected = v.n_accepted == 0
    assert int(rejected.sum()) > 0.5 * B
    assert_distribution(v.bonus[rejected], _residual(P0, Q_FAR), what="bonus at rejection")


def test_second_token_given_first_accepted_is_p1():
    p_rows = torch.stack([P0, P1, P2])
    q_rows = torch.stack([Q_NEAR, Q_FAR])  # second draft mostly rejected
    drafts, v = _single_round(p_rows, q_rows, seed=3)
    has_two = v.n_accepted >= 1
    second = torch.where(v.n_accepted >= 2, drafts[:, 1], v.bonus)[has_two]
    assert_distribution(second, P1, what="second emitted token")
    joint = joint_index([drafts[has_two, 0], second], 6)
    expected = torch.outer(torch.minimum(P0, Q_NEAR), P1).reshape(-1)
    assert_distribution(joint, expected, what="joint of first two tokens (same round)")


def test_all_accepted_bonus_is_p_at_position_k():
    p_rows = torch.stack([P0, P1, P2, P3])
    q_rows = torch.stack([Q_NEAR, P1, P2])  # q == p at 1, 2: always accepted there
    drafts, v = _single_round(p_rows, q_rows, seed=4)
    all_acc = v.n_accepted == 3
    assert int(all_acc.sum()) > 0.9 * B
    assert_distribution(v.bonus[all_acc], P3, what="bonus after K accepted")


def test_point_mass_proposals():
    """q=None: deterministic drafts accept with prob p(x); residual is p with x zeroed."""
    gen = _gen(5)
    drafts = torch.full((B, 2), 1)
    drafts[B // 2 :, 0] = 4  # half the rows draft token 4 first
    p = torch.stack([P0, P1, P2]).expand(B, -1, -1)
    v = verify(p, drafts, None, gen)
    for x, rows in ((1, slice(0, B // 2)), (4, slice(B // 2, B))):
        first = _first_token(drafts[rows], Verdict(v.n_accepted[rows], v.bonus[rows]))
        assert_distribution(first, P0, what=f"first token, point mass at {x}")
        rejected = v.n_accepted[rows] == 0
        zeroed = P0.clone()
        zeroed[x] = 0
        assert_distribution(v.bonus[rows][rejected], zeroed / zeroed.sum(), what="point-mass residual")
    # same via explicit one-hot q
    v2 = verify(p, drafts, point_mass(drafts, 6), _gen(5))
    assert torch.equal(v.n_accepted, v2.n_accepted) and torch.equal(v.bonus, v2.bonus)
    # broken: residual p instead of p with x zeroed
    broken = verify_bonus_from_p(p, drafts, None, _gen(5))
    assert_not_distribution(_first_token(drafts, broken), P0, what="point mass, bonus from p")


def test_n_draft_fewer_than_k_per_row():
    p_rows = torch.stack([P0, P1, P2, P3])
    q_rows = torch.stack([Q_FAR, Q_NEAR, P2])
    gen = _gen(6)
    n_draft = torch.randint(0, 4, (B,), generator=gen)
    drafts, v = _single_round(p_rows, q_rows, seed=7, n_draft=n_draft)
    assert (v.n_accepted <= n_draft).all()
    # first emitted token ~ P0 in every group, including n_draft == 0 (bonus ~ p[0])
    for nd in range(4):
        rows = n_draft == nd
        first = torch.where(v.n_accepted[rows] > 0, drafts[rows, 0], v.bonus[rows])
        assert_distribution(first, P0, what=f"first token, n_draft={nd}")
    assert_distribution(v.bonus[n_draft == 0], P0, what="bonus when n_draft=0")
    # rows whose real drafts were all accepted take the bonus from p[n_draft]
    for nd, p_bonus in ((1, P1), (2, P2)):
        rows = (n_draft == nd) & (v.n_accepted == nd)
        assert int(rows.sum()) > 1000
        assert_distribution(v.bonus[rows], p_bonus, what=f"bonus after n_draft={nd} accepted")
    # padding past n_draft is ignored, even out-of-range token ids
    padded = drafts.clone()
    padded[torch.arange(3) >= n_draft.unsqueeze(1)] = -1
    v_pad = verify(p_rows.expand(B, -1, -1), padded, q_rows.expand(B, -1, -1), _gen(8), n_draft)
    v_ref = verify(p_rows.expand(B, -1, -1), drafts, q_rows.expand(B, -1, -1), _gen(8), n_draft)
    assert torch.equal(v_pad.n_accepted, v_ref.n_accepted) and torch.equal(v_pad.bonus, v_ref.bonus)


def test_zero_residual_falls_back_to_p():
    """q = 2p (unnormalised) rejects half the time with residual 0: bonus must come from p."""
    p_rows = torch.stack([P0, P1])
    gen = _gen(9)
    drafts = _draw(P0.unsqueeze(0), gen)
    v = verify(p_rows.expand(B, -1, -1), drafts, (2 * P0).expand(B, 1, -1), gen)
    assert_distribution(v.bonus[v.n_accepted == 0], P0, what="fallback bonus")


# --- broken variants are detected -----------------------------------------------------


def test_broken_bonus_from_p_is_detected():
    p_rows = torch.stack([P0, P1, P2])
    q_rows = torch.stack([Q_FAR, P1])
    drafts, v = _single_round(p_rows, q_rows, seed=2, verify_fn=verify_bonus_from_p)
    assert_not_distribution(_first_token(drafts, v), P0, what="bonus from p")


def test_broken_argmax_acceptance_is_detected():
    p_rows = torch.stack([P0, P1, P2])
    q_rows = torch.stack([Q_NEAR, P1])
    drafts, v = _single_round(p_rows, q_rows, seed=1, verify_fn=verify_argmax_accept)
    assert_not_distribution(_first_token(drafts, v), P0, what="argmax acceptance")


# --- multi-round generation with a Markov target: joint of the first T tokens ---------


V_M = 5
_LOGITS_P = torch.randn(V_M, V_M, generator=_gen(100)) * 1.2
_LOGITS_Q = _LOGITS_P + torch.randn(V_M, V_M, generator=_gen(101)) * 1.5


def _markov_p(params: SamplingParams | None = None) -> torch.Tensor:
    """Target transition matrix P[c] = p(next | last token c), [V, V]."""
    return logits_to_probs(_LOGITS_P, params or SamplingParams(temperature=1.0))


def _generate(P, K, T, seed, *, Q=None, drafter=None, n_draft_max=None, verify_fn=verify):
    """Speculative generation of T tokens for B rows from context token 0.

    P [V, V] target transitions; the draft is either stochastic (Q [V, V], q passed to
    verify) or deterministic (drafter [V] next-token table, q=None). n_draft_max: each
    round each row uses a random n_draft in 0..K (padding drafts are garbage).
    """
    gen = _gen(seed)
    rows = torch.arange(B)
    out = torch.full((B, T + K + 1), -1)  # [B, T+K+1]
    length = torch.zeros(B, dtype=torch.long)  # [B]
    last = torch.zeros(B, dtype=torch.long)  # [B]
    while (length < T).any():
        c, drafts, qs = last, [], []
        for _ in range(K):
            if Q is not None:
                qs.append(Q[c])  # [B, V]
                c = torch.multinomial(Q[c], 1, generator=gen).squeeze(1)  # [B]
            else:
                c = drafter[c]  # [B]
            drafts.append(c)
        drafts = torch.stack(drafts, 1)  # [B, K]
        p = P[torch.cat([last.unsqueeze(1), drafts], 1)]  # [B, K+1, V]
        q = torch.stack(qs, 1) if Q is not None else None  # [B, K, V]
        n_draft = None
        if n_draft_max is not None:
            n_draft = torch.randint(0, K + 1, (B,), generator=gen)  # [B]
            junk = torch.randint(0, V_M, (B, K), generator=gen)
            drafts = torch.where(torch.arange(K) < n_draft.unsqueeze(1), drafts, junk)
        v = verify_fn(p, drafts, q, gen, n_draft)
        emitted = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.long)], 1)  # [B, K+1]
        emitted[rows, v.n_accepted] = v.bonus
        active = length < T  # [B]
        write = (torch.arange(K + 1) <= v.n_accepted.unsqueeze(1)) & active.unsqueeze(1)  # [B, K+1]
        cols = length.unsqueeze(1) + torch.arange(K + 1)  # [B, K+1]
        out[rows.unsqueeze(1).expand_as(cols)[write], cols[write]] = emitted[write]
        last = torch.where(active, v.bonus, last)
        length = length + torch.where(active, v.n_accepted + 1, 0)
    return out[:, :T]


def _markov_joint(P, T) -> np.ndarray:
    """Exact AR distribution of the first T tokens from context 0, flattened like joint_index."""
    Pn = P.double().numpy()
    probs = np.zeros(V_M**T)
    for i, seq in enumerate(itertools.product(range(V_M), repeat=T)):
        prob, prev = 1.0, 0
        for tok in seq:
            prob, prev = prob * Pn[prev, tok], tok
        probs[i] = prob
    return probs


def _assert_markov(tokens, P, what):
    T = tokens.shape[1]
    assert (tokens >= 0).all()
    assert_distribution(joint_index(list(tokens.T), V_M), _markov_joint(P, T), what=what)


def test_markov_stochastic_draft_joint_of_three_tokens():
    P = _markov_p()
    Q = torch.softmax(_LOGITS_Q, -1)
    tokens = _generate(P, K=3, T=3, seed=20, Q=Q)
    _assert_markov(tokens, P, "SD stochastic draft, K=3")


def test_markov_point_mass_draft():
    P = _markov_p()
    drafter = torch.tensor([1, 2, 0, 4, 3])  # deterministic next-token guess
    tokens = _generate(P, K=2, T=3, seed=21, drafter=drafter)
    _assert_markov(tokens, P, "point-mass (n-gram-like) draft")


def test_markov_saguaro_draft():
    P = _markov_p()
    Q_prime = saguaro_probs(torch.softmax(_LOGITS_Q, -1), fan_out=2, c=0.4)
    tokens = _generate(P, K=2, T=3, seed=22, Q=Q_prime)
    _assert_markov(tokens, P, "Saguaro q'")


def test_markov_top_k_top_p_processed_target():
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.85)
    P = _markov_p(params)
    assert (P == 0).any()  # filtering removed tokens the raw draft still proposes
    Q = torch.softmax(_LOGITS_Q, -1)
    tokens = _generate(P, K=3, T=3, seed=23, Q=Q)
    _assert_markov(tokens, P, "top-k/top-p target")


def test_markov_variable_n_draft():
    P = _markov_p()
    Q = torch.softmax(_LOGITS_Q, -1)
    tokens = _generate(P, K=3, T=3, seed=24, Q=Q, n_draft_max=3)
    _assert_markov(tokens, P, "random n_draft per row")


def test_markov_broken_verifier_is_detected():
    P = _markov_p()
    Q = torch.softmax(_LOGITS_Q, -1)
    tokens = _generate(P, K=2, T=2, seed=25, Q=Q, verify_fn=verify_bonus_from_p)
    assert_not_distribution(joint_index(list(tokens.T), V_M), _markov_joint(P, 2), what="bonus from p")


# --- greedy exactness, purity, shapes -------------------------------------------------


@pytest.mark.parametrize("use_q", [True, False])
def test_greedy_is_deterministic_and_exact(use_q):
    batch, k, vocab = 500, 4, 9
    gen = _gen(30)
    target = torch.randint(0, vocab, (batch, k + 1), generator=gen)  # argmax p per position
    p = point_mass(target, vocab)  # [B, K+1, V]
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.8, target[:, :k], (target[:, :k] + 1) % vocab)
    n_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    q = point_mass(drafts, vocab) if use_q else None
    match = (drafts == target[:, :k]) & (torch.arange(k) < n_draft.unsqueeze(1))
    expected_n = torch.cumprod(match.long(), -1).sum(-1)
    expected_bonus = target[torch.arange(batch), expected_n]
    for seed in (0, 1, 2):
        v = verify(p, drafts, q, _gen(seed), n_draft)
        assert torch.equal(v.n_accepted, expected_n)
        assert torch.equal(v.bonus, expected_bonus)
    v = verify(p, drafts, q, None, n_draft)
    assert torch.equal(v.n_accepted, expected_n) and torch.equal(v.bonus, expected_bonus)


def test_greedy_from_logits_matches_argmax_chain():
    """p and q from logits_to_probs at T=0 (ties included) give argmax-exact verdicts."""
    greedy = SamplingParams(temperature=0.0)
    logits_p = torch.randint(0, 3, (200, 4, 7), generator=_gen(31)).float()  # many ties
    p = logits_to_probs(logits_p, greedy)
    target = logits_p.argmax(-1)
    drafts = torch.where(torch.rand(200, 3, generator=_gen(32)) < 0.7, target[:, :3], 6 - target[:, :3])
    q = logits_to_probs(torch.nn.functional.one_hot(drafts, 7).float() * 5, greedy)
    v = verify(p, drafts, q, _gen(33))
    expected_n = torch.cumprod((drafts == target[:, :3]).long(), -1).sum(-1)
    assert torch.equal(v.n_accepted, expected_n)
    assert torch.equal(v.bonus, target[torch.arange(200), expected_n])


def test_verify_is_pure_and_accepts_other_dtypes():
    gen = _gen(40)
    p = torch.softmax(torch.randn(8, 3, 5, generator=gen), -1).to(torch.bfloat16)
    q = torch.softmax(torch.randn(8, 2, 5, generator=gen), -1)
    drafts = torch.randint(0, 5, (8, 2), generator=gen)
    n_draft = torch.tensor([0, 1, 2, 2, 1, 0, 2, 2])
    before = [t.clone() for t in (p, q, drafts, n_draft)]
    v1 = verify(p, drafts, q, _gen(41), n_draft)
    v2 = verify(p, drafts, q, _gen(41), n_draft)
    for a, b in zip(before, (p, q, drafts, n_draft), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(v1.n_accepted, v2.n_accepted) and torch.equal(v1.bonus, v2.bonus)
    assert v1.n_accepted.dtype == torch.long and v1.bonus.dtype == torch.long
    assert v1.n_accepted.shape == (8,) and v1.bonus.shape == (8,)


def test_k_zero_samples_bonus_from_first_position():
    p = torch.stack([P0]).expand(B, -1, -1)  # [B, 1, V]
    v = verify(p, torch.zeros(B, 0, dtype=torch.long), None, _gen(50))
    assert (v.n_accepted == 0).all()
    assert_distribution(v.bonus, P0, what="K=0 bonus")


def test_shape_mismatch_raises():
    p = torch.ones(2, 3, 4) / 4
    with pytest.raises(ValueError):
        verify(p, torch.zeros(2, 3, dtype=torch.long), None, None)
    with pytest.raises(ValueError):
        verify(p, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, 5) / 5, None)
