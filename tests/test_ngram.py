"""Prompt-lookup proposer: matching, longest-n preference, recency, truncation, speed."""

from __future__ import annotations

import time

import numpy as np

from ssdlocal.speculation.ngram import propose_ngram


def test_simple_match_returns_continuation():
    #          0  1  2  3  4  5  6
    tokens = [5, 6, 7, 8, 9, 5, 6]
    assert propose_ngram(tokens, k=3, n_max=2) == [7, 8, 9]


def test_no_match_returns_empty():
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([7], k=3) == []
    assert propose_ngram([1, 2, 1], k=0) == []


def test_prefers_longest_n():
    # last 1-gram [3] most recently followed by 9 (pos 5); last 2-gram [2, 3] by 4 (pos 1)
    tokens = [2, 3, 4, 0, 3, 9, 1, 2, 3]
    assert propose_ngram(tokens, k=1, n_max=2) == [4]
    assert propose_ngram(tokens, k=1, n_max=1) == [9]
    # n_min bounds the fallback: with n_min=2 and no 2-gram match there is nothing
    assert propose_ngram([0, 3, 9, 1, 3], k=2, n_max=3, n_min=2) == []
    assert propose_ngram([0, 3, 9, 1, 3], k=2, n_max=3, n_min=1) == [9, 1]


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_ngram(tokens, k=1, n_max=2) == [20]
    assert propose_ngram(tokens, k=5, n_max=2) == [20, 1, 2]  # may run into the suffix


def test_k_truncation_and_short_continuations():
    tokens = [4, 5, 6, 7, 8, 9, 4, 5]
    assert propose_ngram(tokens, k=2, n_max=2) == [6, 7]
    assert propose_ngram(tokens, k=100, n_max=2) == [6, 7, 8, 9, 4, 5]


def test_repetition_extends():
    assert propose_ngram([3, 3, 3, 3], k=4, n_max=3) == [3]
    assert propose_ngram([1, 2, 1, 2, 1, 2], k=4, n_max=3) == [1, 2]


def test_accepts_numpy_and_is_fast_on_long_sequences():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=4000)
    start = time.perf_counter()
    for _ in range(50):
        out = propose_ngram(tokens, k=5, n_max=3)
    elapsed = (time.perf_counter() - start) / 50
    assert elapsed < 0.01, f"propose_ngram took {elapsed * 1e3:.1f} ms"
    assert isinstance(out, list) and all(isinstance(t, int) for t in out)
    assert 1 <= len(out) <= 5
