"""K per round: how many tokens to propose, and from which source, to maximise tokens/s.

`CostModel` predicts the target's time to score T tokens and the draft model's time per
token, from measurements it keeps up to date (seeded by a calibration when there is one).
`Acceptance` keeps, per row and per source, a decayed estimate of the chance that the next
proposed token is accepted given the ones before it were. `choose` weighs the options of a
round — a plain step (K=0), a draft-model proposal of K tokens, the suffix proposals as
they are — by expected tokens per second. Everything here depends only on past tokens and
past timings, so verification (and therefore the output) is the same whatever is chosen.
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before a source was seen
PRIOR_SLOPE = 0.05  # target time per extra scored token, relative to one (memory-bound prior)
DECAY = 0.8  # weight of the past in every running estimate (per round)
PROBE_EVERY = 16  # rounds without model proposals before the model is tried again


def _ewma(old: float | None, new: float, decay: float = DECAY) -> float:
    return new if old is None else decay * old + (1 - decay) * new


@dataclass
class CostModel:
    """Seconds per target step by scored tokens T, and per draft-model token."""

    target: dict[int, float] = field(default_factory=dict)  # T -> decayed seconds
    draft_token_s: float | None = None
    samples: dict[int, int] = field(default_factory=dict)  # T -> measurements so far

    def seed(self, target_1: float, target_t: float, t: int, draft_1: float | None) -> None:
        """A calibration: the target at 1 and `t` tokens, the draft at 1 token."""
        self.target.setdefault(1, target_1)
        self.target.setdefault(t, target_t)
        if draft_1 is not None and self.draft_token_s is None:
            self.draft_token_s = draft_1

    def observe_target(self, t: int, seconds: float) -> None:
        """A measured step; the first of a size is replaced by the second (it pays one-time
        costs: allocations, a graph capture), later ones are averaged."""
        seen = self.samples.get(t, 0)
        self.samples[t] = seen + 1
        self.target[t] = seconds if seen <= 1 else _ewma(self.target[t], seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft_token_s = _ewma(self.draft_token_s, seconds / tokens)

    def target_s(self, t: int) -> float | None:
        """Predicted seconds to score t tokens: measured, interpolated between the nearest
        measured sizes, or extrapolated (with the prior slope from one measurement)."""
        known = sorted(self.target)
        if not known:
            return None
        if t in self.target:
            return self.target[t]
        lower = [x for x in known if x < t]
        upper = [x for x in known if x > t]
        if lower and upper:
            a, b = lower[-1], upper[0]
            return self.target[a] + (self.target[b] - self.target[a]) * (t - a) / (b - a)
        if len(known) >= 2:  # extend the line through the two nearest points
            a, b = (known[-2], known[-1]) if lower else (known[0], known[1])
            slope = (self.target[b] - self.target[a]) / (b - a)
            ref = b if lower else a
            return max(self.target[ref] + slope * (t - ref), 1e-9)
        ref = known[0]
        return self.target[ref] * (1 + PRIOR_SLOPE * t) / (1 + PRIOR_SLOPE * ref)


@dataclass
class Acceptance:
    """Per-row, per-source decayed chance that a proposed token is accepted given the
    earlier ones were (the rate of a capped geometric accepted length)."""

    rows: dict[tuple[int, str], float] = field(default_factory=dict)

    def rate(self, row: int, source: str) -> float:
        return self.rows.get((row, source), PRIOR_ACCEPTANCE)

    def observe(self, row: int, source: str, proposed: int, accepted: int) -> None:
        """A proposal of `proposed` tokens of which the first `accepted` were accepted."""
        if proposed <= 0:
            return
        tried = accepted + (1 if accepted < proposed else 0)  # tokens judged
        self.rows[(row, source)] = _ewma(self.rows.get((row, source)), accepted / tried)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a round yields with K proposals accepted at `rate` each: 1 + a + ... + a^K."""
    return float(sum(rate**j for j in range(k + 1)))


def suffix_expected(confidence: Sequence[float], rate: float) -> float:
    """Tokens a round yields from a suffix proposal: 1 + sum_j conf_j * rate^j (the share
    of history behind token j, discounted by how often this row's suffix tokens held)."""
    return 1.0 + float(sum(c * rate ** (j + 1) for j, c in enumerate(confidence)))


@dataclass(frozen=True)
class Choice:
    """What a round proposes: `model_k` tokens from the draft model (0: none), and for each
    row how many of its suffix tokens to use (0: none); `width` = the scored drafts."""

    model_k: int
    suffix_len: tuple[int, ...]
    width: int
    tokens_per_s: float  # the prediction that won


def choose(costs: CostModel, model_rates: Sequence[float] | None, suffix_conf: Sequence[Sequence[float]],
           suffix_rates: Sequence[float], k_max: int, active: Sequence[bool], explore: bool = False) -> Choice:  # fmt: skip
    """The (model K, suffix lengths) maximising expected tokens per second over the active rows.

    model_rates: per-row acceptance of the draft model (None: no draft model); suffix_conf:
    per-row confidences of the suffix proposal (empty: none); a row uses whichever of its
    two proposals yields more, capped by the round's width. `explore`: instead, the option
    whose width was measured least (estimates of widths never tried stay guesses)."""
    rows = [b for b, on in enumerate(active) if on]
    best = Choice(0, (0,) * len(active), 0, 0.0)
    t1 = costs.target_s(1)
    if t1 is None or not rows:
        return best
    if not explore:
        best = Choice(0, (0,) * len(active), 0, len(rows) / t1)
    lengths = {min(len(suffix_conf[b]), k_max) for b in rows}
    model_options = range(0, k_max + 1) if model_rates is not None else [0]
    for model_k in model_options:
        for width in sorted({model_k, *[n for n in lengths if n > model_k]}):
            if width == 0:
                continue
            t = costs.target_s(width + 1)
            draft = model_k * (costs.draft_token_s or 0.0)
            gain, lens = 0.0, [0] * len(active)
            for b in rows:
                m = expected_tokens(model_rates[b], model_k) if model_k else 1.0
                n = min(len(suffix_conf[b]), width)
                s = suffix_expected(suffix_conf[b][:n], suffix_rates[b]) if n else 1.0
                if s > m:
                    lens[b] = n
                gain += max(m, s)
            rate = gain / (t + draft)
            if explore:  # the least measured width (the widest of those): its cost is the guess
                rate = -costs.samples.get(width + 1, 0) + width / 1000
            if rate > best.tokens_per_s or (explore and best.width == 0):
                best = Choice(model_k, tuple(lens), width, rate)
    return best
