"""Saguaro fan-out allocation (pure): how many bonus candidates to cache per accepted length.

With per-token acceptance `a` and miss rate ~ F^-r, the optimal allocation is the
capped-geometric allocation F_k ∝ a^(k/(1+r)) for k < K and
F_K ∝ a^(K/(1+r)) (1-a)^(-1/(1+r)). Knows nothing about models or processes.
"""

from __future__ import annotations

import math


def capped_geometric(k: int, budget: int, acceptance: float, power: float = 1.0) -> tuple[int, ...]:
    """Integer fan-out (F_0..F_K), summing to `budget`, from the capped-geometric rule.

    acceptance: estimated per-token acceptance a, clamped to [0.01, 0.99].
    power: the miss-rate power-law exponent r > 0.
    Rounding is largest-remainder, so the total is exactly `budget` (budget >= 0).
    """
    if k < 0 or budget < 0:
        raise ValueError("k and budget must be >= 0")
    a = min(max(acceptance, 0.01), 0.99)
    r = max(power, 1e-3)
    weights = [a ** (i / (1 + r)) for i in range(k)]
    weights.append(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    total = sum(weights)
    exact = [budget * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    left = budget - sum(counts)
    by_remainder = sorted(range(k + 1), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


class FanOutPlanner:
    """Online fan-out: estimates acceptance and sizes the budget to the verify time.

    The budget (branches per row) grows while pre-speculation finishes inside one
    target verification and shrinks when it does not, so the draft never makes the
    target wait on a hit.
    """

    def __init__(self, k: int, budget: int | None = None, min_budget: int | None = None, max_budget: int = 32):
        self.k = k
        # below one candidate per accepted length the hit rate collapses, while a narrower
        # tree saves little time on memory-bound hardware: K+1 is the default floor
        self.min_budget = min_budget if min_budget is not None else min(k + 1, max_budget)
        self.max_budget = max_budget
        self.budget = budget if budget is not None else k + 1
        self.accepted = 1.0  # pseudo-counts: prior acceptance 0.7
        self.tried = 1.0 / 0.7
        self.power = 1.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    def observe_acceptance(self, n_drafted: int, n_accepted: int) -> None:
        """A row's round: n_accepted of n_drafted drafts accepted (first rejection stops)."""
        # Each accepted draft is a success; the first rejected one a failure.
        self.accepted += n_accepted
        self.tried += n_accepted + (1 if n_accepted < n_drafted else 0)

    def observe_timing(self, prespec_s: float, verify_s: float, completed: bool = True) -> None:
        """Grow the budget if pre-speculation finished in < 80% of a verify; shrink it
        if it took longer than a verify or had to be cut short (`completed` False)."""
        if verify_s <= 0:
            return
        if (prespec_s > verify_s or not completed) and self.budget > self.min_budget:
            self.budget -= 1
        elif completed and prespec_s < 0.8 * verify_s and self.budget < self.max_budget:
            self.budget += 1

    def plan(self) -> tuple[int, ...]:
        return capped_geometric(self.k, self.budget, self.acceptance, self.power)
