"""Prompt-lookup (n-gram) proposer: drafts by copying what followed an earlier match.

Pure function of the token history; used as `--draft ngram` and as SSD's fast backup.
Its proposals are deterministic, so verification treats them as point masses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens.

    Tries n = n_max down to n_min and uses the first (longest) n that matches. The
    continuation may run into the matched suffix itself (repeats extend naturally).
    Returns [] when nothing matches or k <= 0.
    """
    if k <= 0 or n_max < 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)  # [L]
    length = history.shape[0]
    for n in range(min(n_max, length - 1), max(n_min, 1) - 1, -1):
        suffix = history[length - n :]  # [n]
        # Candidate starts s in 0..L-n-1 (the suffix itself, s = L-n, is excluded):
        # first filter on the last suffix token, then check the rest.
        starts = np.flatnonzero(history[n - 1 : length - 1] == suffix[-1])  # [M]
        for j in range(n - 1):
            if starts.size == 0:
                break
            starts = starts[history[starts + j] == suffix[j]]  # [M'] still matching
        if starts.size:
            s = int(starts[-1])  # most recent occurrence
            return history[s + n : s + n + k].tolist()
    return []
