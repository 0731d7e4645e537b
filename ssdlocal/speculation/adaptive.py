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
ROW_DECAY = 0.6  # ... in a row's own acceptance (one answer changes character quickly)
PROBE_EVERY = 16  # rounds without model proposals before the model is tried again
MAX_PROBE_EVERY = 256  # the longest interval probes and explored widths back off to
PRIOR_DRAFT = 0.3  # a draft-model token's cost, relative to a target step, before it is measured
CATCH_UP_SHARE = 0.1  # a token the draft reads in bulk costs this share of one it decodes
CATCH_UP_ROUNDS = 8  # rounds a catch-up is charged over (it is paid once, then drafting is cheap)
# A draft-model proposal must predict this much more than the best option without the model
# (a plain step or suffix tokens): a model round also pays what the cost model does not time
# (the draft's cache upkeep, its q rows, a second runner's bookkeeping), and taking proposals
# predicted to win by a few percent left SD 6-10% below plain steps on chat prompts on the
# llama.cpp backend. Where the model is accepted often (code edits) it wins by far more.
MODEL_MARGIN = 1.1


def _ewma(old: float | None, new: float, decay: float = DECAY) -> float:
    return new if old is None else decay * old + (1 - decay) * new


@dataclass
class CostModel:
    """Seconds per target step by scored tokens T, and per draft-model token; and
    `probe_every`, the rounds without model proposals before the model is tried again
    (the drafter doubles it while probes do not pay and resets it when the model wins on
    its merits); `explore_every`, the plain rounds before a wider step is tried to keep its
    cost current (doubled after each such try, reset when a round speculates on its
    merits). All of it is the engine's, kept across calls: a conversation whose draft
    does not pay stops paying a probe's catch-up at the start of every answer, and a chat
    where nothing pays stops paying a wide step every 16 tokens."""

    target: dict[int, float] = field(default_factory=dict)  # T -> decayed seconds
    draft_token_s: float | None = None
    samples: dict[int, int] = field(default_factory=dict)  # T -> measurements so far
    probe_every: int = PROBE_EVERY
    explore_every: int = PROBE_EVERY

    def seed(self, target_1: float, target_t: float, t: int, draft_1: float | None) -> None:
        """A calibration: the target at 1 and `t` tokens, the draft at 1 token."""
        self.target.setdefault(1, target_1)
        self.target.setdefault(t, target_t)
        if draft_1 is not None and self.draft_token_s is None:
            self.draft_token_s = draft_1

    def seed_widths(self, seconds: dict[int, float]) -> None:
        """Measured step times by width (a calibration): each counts as settled."""
        for t, s in seconds.items():
            self.target[t] = s
            self.samples[t] = max(self.samples.get(t, 0), 2)

    def observe_target(self, t: int, seconds: float) -> None:
        """A measured step; the first of a size is replaced by the second (it pays one-time
        costs: allocations, a graph capture), later ones are averaged."""
        seen = self.samples.get(t, 0)
        self.samples[t] = seen + 1
        self.target[t] = seconds if seen <= 1 else _ewma(self.target[t], seconds)

    @property
    def knows_draft(self) -> bool:
        """Whether the target's steps and the draft model's tokens have been timed (a
        calibration, or rounds), so `model_could_pay` answers from measurements."""
        return bool(self.target) and self.draft_token_s is not None

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


PRIORS = {"model": PRIOR_ACCEPTANCE, "suffix:2": 0.4, "suffix:4": 0.6, "suffix:8": 0.8, "suffix:16": 0.9}


def suffix_key(match_len: int) -> str:
    """The acceptance class of a suffix proposal: how long a context its match agreed on."""
    bucket = 16 if match_len >= 16 else 8 if match_len >= 8 else 4 if match_len >= 4 else 2
    return f"suffix:{bucket}"


@dataclass
class Acceptance:
    """Decayed chance that a proposed token is accepted given the earlier ones were (the rate
    of a capped geometric accepted length), by source ("model", or a suffix_key): per row
    of this call, and `shared` across rows and calls (the engine's; a new row's prior)."""

    shared: dict[str, float] = field(default_factory=dict)
    rows: dict[tuple[int, str], float] = field(default_factory=dict)

    def rate(self, row: int, key: str) -> float:
        found = self.rows.get((row, key))
        return found if found is not None else self.shared.get(key, PRIORS.get(key, PRIOR_ACCEPTANCE))

    def observe(self, row: int, key: str, proposed: int, accepted: int) -> None:
        """A proposal of `proposed` tokens of which the first `accepted` were accepted."""
        if proposed <= 0:
            return
        tried = accepted + (1 if accepted < proposed else 0)  # tokens judged
        seen = accepted / tried
        self.rows[(row, key)] = _ewma(self.rate(row, key), seen, ROW_DECAY)
        self.shared[key] = _ewma(self.shared.get(key, PRIORS.get(key, PRIOR_ACCEPTANCE)), seen)


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


def model_could_pay(costs: CostModel, k_max: int, active: Sequence[bool]) -> bool:
    """Whether `choose` would take a draft-model proposal on `costs` if every drafted token
    were accepted. If not, no acceptance makes the model pay (e.g. a CPU where scoring K+1
    tokens plus K draft tokens costs more than K+1 plain steps): probing it, or loading it
    for a call, only costs time."""
    n = len(active)
    return choose(costs, [1.0] * n, [()] * n, [0.0] * n, k_max, active).model_k > 0


def model_cannot_pay(costs: CostModel, k_max: int, active: Sequence[bool]) -> bool:
    """Whether measured costs (CostModel.knows_draft) say no acceptance makes a draft-model
    proposal pay (model_could_pay): then the model need not even be loaded. Unmeasured
    costs say nothing (False)."""
    return costs.knows_draft and not model_could_pay(costs, k_max, active)


def choose(
    costs: CostModel,
    model_rates: Sequence[float] | None,
    suffix_conf: Sequence[Sequence[float]],
    suffix_rates: Sequence[float],
    k_max: int,
    active: Sequence[bool],
    explore: bool = False,
    catch_up: int = 0,
) -> Choice:
    """The (model K, round width, suffix lengths) maximising expected tokens per second.

    model_rates: per-row acceptance of the draft model (None: no draft model); suffix_conf:
    per-row confidences of the suffix proposal (empty: none); suffix_rates: per-row
    acceptance of its suffix proposal. A row takes whichever of its two proposals yields
    more, its suffix proposal cut to the round's width. `catch_up`: committed tokens the
    draft model must read before it can propose (its cost counts against the model).
    `explore`: instead, the suffix-only option whose width was measured least (estimates of
    widths never tried stay guesses; the model is probed separately). An option with model
    drafts counts its prediction divided by MODEL_MARGIN (the winner's tokens_per_s too)."""
    rows = [b for b, on in enumerate(active) if on]
    none = (0,) * len(active)
    t1 = costs.target_s(1)
    if t1 is None or not rows:
        return Choice(0, none, 0, 0.0)
    model = {b: [expected_tokens(model_rates[b], k) for k in range(k_max + 1)] for b in rows} if model_rates else None
    suffix = {b: _cumulative(suffix_conf[b][:k_max], suffix_rates[b]) for b in rows}  # [n] -> tokens
    best = Choice(0, none, 0, -1.0 if explore else len(rows) / t1)
    draft_s = costs.draft_token_s if costs.draft_token_s is not None else PRIOR_DRAFT * t1
    catch_up_s = catch_up * draft_s * CATCH_UP_SHARE / CATCH_UP_ROUNDS  # paid once, shared by the next rounds
    for model_k in range(k_max + 1) if model is not None and not explore else (0,):
        for width in range(max(model_k, 1), k_max + 1):
            if model_k == 0 and all(len(suffix[b]) == 1 for b in rows):
                break  # no proposal at all
            t = costs.target_s(width + 1) + (model_k * draft_s + catch_up_s if model_k else 0.0)
            gain, lens = 0.0, [0] * len(active)
            for b in rows:
                m = model[b][model_k] if model is not None else 1.0
                n = min(len(suffix[b]) - 1, width)
                if suffix[b][n] > m:
                    lens[b], m = n, suffix[b][n]
                gain += m
            rate = -costs.samples.get(width + 1, 0) + width / 1000 if explore else gain / t
            if model_k and not explore:
                rate /= MODEL_MARGIN
            if rate > best.tokens_per_s:
                best = Choice(model_k, tuple(lens), width, rate)
    return best


def _cumulative(confidence: Sequence[float], rate: float) -> list[float]:
    """Expected tokens of a suffix proposal cut to n tokens, n = 0..len (see suffix_expected)."""
    out = [1.0]
    for j, c in enumerate(confidence):
        out.append(out[-1] + c * rate ** (j + 1))
    return out
