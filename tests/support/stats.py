"""Chi-square harness for statistical losslessness tests (reusable across the suite).

Rule: a test fails only when the p-value is below ALPHA = 1e-4, so a correct
implementation fails fewer than 1 in 10^4 runs per assertion. Seeds are fixed anyway
so CI is deterministic; thresholds come from the rule, not from the seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

ALPHA = 1e-4
MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per bin


def _as_int_array(samples) -> np.ndarray:
    if hasattr(samples, "detach"):  # torch tensor
        samples = samples.detach().cpu().numpy()
    return np.asarray(samples, dtype=np.int64).reshape(-1)


def _as_float_array(probs) -> np.ndarray:
    if hasattr(probs, "detach"):
        probs = probs.detach().cpu().double().numpy()
    return np.asarray(probs, dtype=np.float64).reshape(-1)


def chi_square_pvalue(samples, expected_probs) -> float:
    """p-value of Pearson's chi-square test: do `samples` (ints in [0, C)) follow `expected_probs`?

    Any sample in a category of expected probability 0 (or out of range) gives 0.0.
    Categories with fewer than MIN_EXPECTED expected counts are pooled into one bin.
    """
    samples = _as_int_array(samples)
    expected_probs = _as_float_array(expected_probs)
    n_cat = expected_probs.size
    n = samples.size
    if n == 0:
        raise ValueError("no samples")
    if samples.min() < 0 or samples.max() >= n_cat:
        return 0.0
    expected_probs = expected_probs / expected_probs.sum()
    observed = np.bincount(samples, minlength=n_cat).astype(np.float64)
    impossible = expected_probs <= 0
    if observed[impossible].sum() > 0:
        return 0.0
    observed, expected = observed[~impossible], n * expected_probs[~impossible]
    small = expected < MIN_EXPECTED
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        observed, expected = observed[~small], expected[~small]
        if pooled_exp >= MIN_EXPECTED or observed.size == 0:
            observed = np.append(observed, pooled_obs)
            expected = np.append(expected, pooled_exp)
        else:  # too little mass to stand alone: merge into the smallest remaining bin
            i = int(np.argmin(expected))
            observed[i] += pooled_obs
            expected[i] += pooled_exp
    if observed.size < 2:
        return 1.0  # a single bin carries no information
    return float(stats.chisquare(observed, expected).pvalue)


def assert_distribution(samples, expected_probs, alpha: float = ALPHA, what: str = "") -> float:
    """Fail when the chi-square p-value of `samples` vs `expected_probs` is below alpha."""
    pvalue = chi_square_pvalue(samples, expected_probs)
    n = _as_int_array(samples).size
    assert pvalue >= alpha, f"{what or 'samples'}: chi-square p-value {pvalue:.3g} < {alpha} (n={n})"
    return pvalue


def assert_not_distribution(samples, expected_probs, alpha: float = ALPHA, what: str = "") -> float:
    """The opposite check, used to prove a deliberately broken implementation is caught."""
    pvalue = chi_square_pvalue(samples, expected_probs)
    assert pvalue < alpha, f"{what or 'samples'}: broken variant not detected (p-value {pvalue:.3g})"
    return pvalue


def joint_index(columns: Sequence, vocab_size: int):
    """Flatten token columns (t0, t1, ...) into one category index t0*V^(n-1) + ... ."""
    index = None
    for col in columns:
        index = col if index is None else index * vocab_size + col
    return index


def joint_probs(marginals: Sequence, vocab_size: int) -> np.ndarray:
    """Outer product of independent per-position distributions, flattened like joint_index."""
    out = np.ones(1)
    for m in marginals:
        out = np.outer(out, _as_float_array(m)).reshape(-1)
    assert out.size == vocab_size ** len(marginals)
    return out
