"""logits_to_probs, seeded sample() and Saguaro q' (pure math, CPU, fixed seeds)."""

from __future__ import annotations

import pytest
import torch
from support.stats import assert_distribution, assert_not_distribution

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs, saguaro_probs, sample
from ssdlocal.core.verify import verify


def _params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


# --- logits_to_probs -------------------------------------------------------------


def test_greedy_is_one_hot_at_argmax_with_first_index_tie_rule():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 1.0, 0.0, 5.0]])
    probs = logits_to_probs(logits, _params(temperature=0.0, top_k=2, top_p=0.5))
    assert probs.dtype == torch.float32
    expected_idx = torch.argmax(logits, dim=-1)
    assert torch.equal(probs.argmax(-1), expected_idx)
    assert torch.equal(probs, torch.nn.functional.one_hot(expected_idx, 4).float())


def test_softmax_with_temperature_and_any_input_dtype():
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0))
    for temp in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits.to(torch.bfloat16), _params(temperature=temp))
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        ref = torch.softmax(logits.to(torch.bfloat16).float() / temp, dim=-1)
        torch.testing.assert_close(probs, ref)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 7))
    hot = logits_to_probs(logits, _params(temperature=0.5))
    cold = logits_to_probs(logits, _params(temperature=2.0))
    assert (hot.max(-1).values >= cold.max(-1).values).all()  # lower T is peakier


def test_top_k_keeps_k_largest_and_renormalises():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, _params(temperature=1.0, top_k=2))
    assert (probs[0, [0, 3, 4]] == 0).all()
    ref = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    torch.testing.assert_close(probs[0, [1, 2]], ref)
    # k >= V is the same as off
    full = logits_to_probs(logits, _params(temperature=1.0, top_k=5))
    torch.testing.assert_close(full, torch.softmax(logits, -1))
    # exactly k survive even with ties
    tied = logits_to_probs(torch.zeros(1, 6), _params(temperature=1.0, top_k=3))
    assert int((tied > 0).sum()) == 3


def test_top_p_edges():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    # top_p = 1 keeps everything
    full = logits_to_probs(logits, _params(temperature=1.0, top_p=1.0))
    torch.testing.assert_close(full, probs_in)
    # tiny top_p keeps exactly the top token
    one = logits_to_probs(logits, _params(temperature=1.0, top_p=1e-6))
    assert torch.equal(one, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # smallest prefix with mass >= top_p: 0.5 + 0.3 >= 0.7 -> two tokens
    two = logits_to_probs(logits, _params(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(two, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # mass exactly reached by the first token keeps only it? 0.5 >= 0.5 -> one token
    half = logits_to_probs(logits, _params(temperature=1.0, top_p=0.5))
    assert int((half > 0).sum()) == 1
    # 0.81 needs three tokens
    three = logits_to_probs(logits, _params(temperature=1.0, top_p=0.81))
    assert int((three > 0).sum()) == 3


def test_top_k_then_top_p_uses_renormalised_top_k_mass():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # after top-k=2: [0.571, 0.429]; top_p=0.55 keeps just the first
    probs = logits_to_probs(logits, _params(temperature=1.0, top_k=2, top_p=0.55))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    probs = logits_to_probs(logits, _params(temperature=1.0, top_k=2, top_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_rows_sum_to_one_batched():
    logits = torch.randn(4, 5, 50, generator=torch.Generator().manual_seed(1)) * 3
    for params in (
        _params(temperature=0.0),
        _params(temperature=0.8, top_k=10),
        _params(temperature=1.3, top_p=0.9),
        _params(temperature=1.0, top_k=20, top_p=0.5),
    ):
        probs = logits_to_probs(logits, params)
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, 5))
        assert (probs >= 0).all()


# --- sample ------------------------------------------------------------------------


def test_sample_one_hot_rows_are_exact_and_seeded_results_reproducible():
    probs = torch.nn.functional.one_hot(torch.tensor([3, 0, 7, 7]), 8).float()
    assert torch.equal(sample(probs, torch.Generator().manual_seed(0)), torch.tensor([3, 0, 7, 7]))
    assert torch.equal(sample(probs, None), torch.tensor([3, 0, 7, 7]))
    dense = torch.softmax(torch.randn(100, 8, generator=torch.Generator().manual_seed(2)), -1)
    a = sample(dense, torch.Generator().manual_seed(5))
    b = sample(dense, torch.Generator().manual_seed(5))
    assert a.dtype == torch.long and a.shape == (100,)
    assert torch.equal(a, b)


def test_sample_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1e-30]]).repeat(5000, 1)
    tokens = sample(probs, torch.Generator().manual_seed(3))
    assert ((tokens[0::2] == 1) | (tokens[0::2] == 2)).all()
    assert (tokens[1::2] == 3).all()


def test_sample_distribution_chi_square():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    tokens = sample(probs.expand(40_000, -1), torch.Generator().manual_seed(4))
    assert_distribution(tokens, probs, what="sample()")


# --- Saguaro q' --------------------------------------------------------------------


def test_saguaro_scales_top_f_and_renormalises():
    q = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    out = saguaro_probs(q, fan_out=2, c=0.5)
    expected0 = torch.tensor([0.1, 0.2, 0.2, 0.15])
    torch.testing.assert_close(out[0], expected0 / expected0.sum())
    torch.testing.assert_close(out.sum(-1), torch.ones(2))
    assert int((out[1] < 0.25).sum()) == 2  # exactly F entries scaled down even with ties
    torch.testing.assert_close(saguaro_probs(q, 0, 0.5), q)
    torch.testing.assert_close(saguaro_probs(q, 3, 1.0), q)
    # F >= V scales every entry: unchanged after renormalising
    torch.testing.assert_close(saguaro_probs(q, 10, 0.5), q)
    q3 = torch.softmax(torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(0)), -1)
    assert saguaro_probs(q3, 2, 0.3).shape == (2, 3, 9)


def test_saguaro_sampling_is_lossless_when_verified_against_q_prime():
    """Drafts sampled from q' and verified with q' give emitted first tokens ~ p."""
    batch = 40_000
    gen = torch.Generator().manual_seed(11)
    p = torch.tensor([[0.3, 0.25, 0.2, 0.1, 0.1, 0.05], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    q_prime = saguaro_probs(q, fan_out=2, c=0.3)
    drafts = torch.multinomial(q_prime, batch, replacement=True, generator=gen).view(batch, 1)
    p_b = p.expand(batch, -1, -1)
    q_b = q_prime.expand(batch, 1, -1)
    verdict = verify(p_b, drafts, q_b, gen)
    first = torch.where(verdict.n_accepted > 0, drafts[:, 0], verdict.bonus)
    assert_distribution(first, p[0], what="Saguaro q' verified against q'")
    # Verifying against the original q instead of q' (the actual proposal) is biased.
    wrong = verify(p_b, drafts, q.expand(batch, 1, -1), gen)
    first_wrong = torch.where(wrong.n_accepted > 0, drafts[:, 0], wrong.bonus)
    assert_not_distribution(first_wrong, p[0], what="q' drafts verified against q")


@pytest.mark.parametrize("bad", [-0.5, 0.0])
def test_saguaro_rejects_bad_c(bad):
    with pytest.raises(ValueError):
        saguaro_probs(torch.ones(1, 4) / 4, 2, bad)
