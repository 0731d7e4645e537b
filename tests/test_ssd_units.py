"""Unit tests of SSD's pure parts: fan-out allocation and planner, speculation cache and
bonus candidates, backup choice, CPU split. No models, no processes."""

from __future__ import annotations

from ssdlocal.backends.base import kept_logits

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.hostsync import detached_site
from ssdlocal.placement.cpus import split_cpus
from ssdlocal.speculation.backup import BackupChooser, expected_rate
from ssdlocal.speculation.fanout import FanOutPlanner, capped_geometric
from ssdlocal.speculation.cache import Branch, SpeculationCache, bonus_candidates, bonus_candidates_batch

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)


# ----------------------------------------------------------------- capped_geometric
@pytest.mark.parametrize("k", [0, 1, 2, 4, 7])
@pytest.mark.parametrize("budget", [0, 1, 3, 5, 17, 64])
@pytest.mark.parametrize("acceptance", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_capped_geometric_sums_to_budget(k, budget, acceptance):
    fan = capped_geometric(k, budget, acceptance)
    assert len(fan) == k + 1
    assert sum(fan) == budget
    assert all(isinstance(f, int) and f >= 0 for f in fan)


@pytest.mark.parametrize("acceptance", [0.1, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("budget", [4, 9, 32])
def test_capped_geometric_non_increasing_before_last(acceptance, power, budget):
    """For a < 1 the weights a^(k/(1+r)) decrease in k, and largest-remainder rounding
    keeps the integer counts non-increasing over k = 0..K-1."""
    fan = capped_geometric(4, budget, acceptance, power)
    head = fan[:-1]
    assert all(x >= y for x, y in pairwise(head)), fan


def test_capped_geometric_matches_formula_when_divisible():
    """Large budget: counts are within 1 of budget * w_k / sum(w) for the capped-geometric formula."""
    k, budget, a, r = 3, 1000, 0.8, 1.0
    weights = [a ** (i / (1 + r)) for i in range(k)]
    weights.append(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    exact = [budget * w / sum(weights) for w in weights]
    fan = capped_geometric(k, budget, a, r)
    assert all(abs(f - e) < 1.0 for f, e in zip(fan, exact)), (fan, exact)


def test_capped_geometric_last_entry_boost():
    """F_K carries the extra (1-a)^(-1/(1+r)) factor: with high acceptance the
    all-accepted position gets the largest share, with low acceptance F_0 does."""
    high = capped_geometric(4, 40, 0.9)
    assert high[-1] == max(high) and high[-1] > high[-2]
    low = capped_geometric(4, 40, 0.2)
    assert low[0] == max(low) and low[-1] < low[0]
    # ratio F_K / F_{K-1} = (a / (1-a))^(1/(1+r)) > 1 exactly when a > 1/2
    assert capped_geometric(2, 300, 0.6)[-1] > capped_geometric(2, 300, 0.6)[-2]
    assert capped_geometric(2, 300, 0.4)[-1] < capped_geometric(2, 300, 0.4)[-2]


def test_capped_geometric_power_flattens():
    """A larger miss-rate exponent r flattens the geometric decay (a^(k/(1+r)))."""
    steep = capped_geometric(4, 100, 0.5, power=0.1)
    flat = capped_geometric(4, 100, 0.5, power=10.0)
    assert steep[0] - steep[3] > flat[0] - flat[3] >= 0


def test_capped_geometric_edge_cases():
    assert capped_geometric(0, 5, 0.7) == (5,)
    assert capped_geometric(3, 0, 0.7) == (0, 0, 0, 0)
    # acceptance is clamped, so extreme or out-of-range values still give a valid plan
    for a in (-1.0, 0.0, 1.0, 2.0):
        fan = capped_geometric(3, 10, a)
        assert sum(fan) == 10 and len(fan) == 4
    assert capped_geometric(3, 10, 1.0) == capped_geometric(3, 10, 0.99)
    assert sum(capped_geometric(3, 10, 0.7, power=0.0)) == 10  # r clamped > 0
    with pytest.raises(ValueError):
        capped_geometric(-1, 4, 0.5)
    with pytest.raises(ValueError):
        capped_geometric(3, -1, 0.5)


# ----------------------------------------------------------------- FanOutPlanner
def test_planner_defaults():
    planner = FanOutPlanner(4)
    assert planner.budget == 5  # K + 1: one candidate per accepted length to start
    assert abs(planner.acceptance - 0.7) < 1e-9
    fan = planner.plan()
    assert len(fan) == 5 and sum(fan) == 5


def test_planner_timing_grows_and_shrinks_within_bounds():
    planner = FanOutPlanner(3, budget=4, min_budget=2, max_budget=6)
    planner.observe_timing(prespec_s=0.1, verify_s=1.0)  # lots of slack: grow
    assert planner.budget == 5
    planner.observe_timing(prespec_s=0.9, verify_s=1.0)  # between 80% and 100%: hold
    assert planner.budget == 5
    for _ in range(10):
        planner.observe_timing(0.0, 1.0)
    assert planner.budget == 6  # capped at max_budget
    planner.observe_timing(prespec_s=1.5, verify_s=1.0)  # too slow: shrink
    assert planner.budget == 5
    for _ in range(10):
        planner.observe_timing(2.0, 1.0)
    assert planner.budget == 2  # floored at min_budget
    planner.observe_timing(5.0, 0.0)  # no verify timing: ignored
    planner.observe_timing(5.0, -1.0)
    assert planner.budget == 2
    assert sum(planner.plan()) == 2


def test_planner_acceptance_adapts_allocation():
    good, bad = FanOutPlanner(4, budget=20), FanOutPlanner(4, budget=20)
    for _ in range(50):
        good.observe_acceptance(4, 4)  # every draft accepted
        bad.observe_acceptance(4, 0)  # first draft rejected every time
    assert good.acceptance > 0.95
    assert bad.acceptance < 0.05
    g, b = good.plan(), bad.plan()
    assert sum(g) == sum(b) == 20
    assert g[-1] == max(g) and g[-1] > b[-1]  # all-accepted outcome dominates
    assert b[0] == max(b) and b[0] > g[0]  # reject-at-first outcome dominates


def test_planner_acceptance_counts_first_rejection_only():
    planner = FanOutPlanner(4)
    acc0, tried0 = planner.accepted, planner.tried
    planner.observe_acceptance(4, 2)  # 2 accepted + 1 rejected (later drafts never tried)
    assert planner.accepted - acc0 == 2
    assert planner.tried - tried0 == 3
    planner.observe_acceptance(2, 2)  # all of 2 accepted: no failure
    assert planner.tried - tried0 == 5
    planner.observe_acceptance(0, 0)  # nothing drafted: nothing learned
    assert planner.tried - tried0 == 5


# ----------------------------------------------------------------- speculation cache
def _branch(row, n, bonus, k=3, v=8):
    return Branch(row, n, bonus, tuple(range(k)), torch.zeros(k, v), None, slot_start=10 * row)


def test_cache_keys_and_lookup():
    cache = SpeculationCache()
    assert len(cache) == 0 and cache.get(0, 0, 0) is None
    a, b, c = _branch(0, 0, 5), _branch(0, 2, 5), _branch(1, 0, 5)
    for br in (a, b, c):
        cache.put(br)
    assert len(cache) == 3
    assert set(cache.keys()) == {(0, 0, 5), (0, 2, 5), (1, 0, 5)}
    assert cache.get(0, 0, 5) is a
    assert cache.get(0, 2, 5) is b
    assert cache.get(1, 0, 5) is c
    # each key component matters
    assert cache.get(0, 1, 5) is None
    assert cache.get(0, 0, 6) is None
    assert cache.get(2, 0, 5) is None
    # same key overwrites
    a2 = _branch(0, 0, 5, k=2)
    cache.put(a2)
    assert len(cache) == 3 and cache.get(0, 0, 5) is a2
    cache.clear()
    assert len(cache) == 0 and cache.keys() == [] and cache.get(1, 0, 5) is None


def test_bonus_candidates_excludes_drafted_token():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0, 1.0])  # ranking 1, 2, 3, 4, 5, 0
    assert bonus_candidates(logits, drafted=1, fan_out=3, params=GREEDY) == [2, 3, 4]
    assert bonus_candidates(logits, drafted=3, fan_out=3, params=GREEDY) == [1, 2, 4]
    # a drafted token outside the top F: nothing to exclude, still F candidates
    assert bonus_candidates(logits, drafted=0, fan_out=2, params=GREEDY) == [1, 2]
    # the all-accepted position (drafted None) keeps the draft's top-1
    assert bonus_candidates(logits, drafted=None, fan_out=3, params=GREEDY) == [1, 2, 3]
    for drafted in range(6):
        got = bonus_candidates(logits, drafted, 4, SAMPLED)
        assert drafted not in got and len(got) == 4 and len(set(got)) == 4


def test_bonus_candidates_of_a_whole_round_in_one_read_equal_one_position_at_a_time():
    """The worker's batched top-k (every row and accepted length at once, one host read)
    picks exactly what each position alone would, whatever each position's fan-out."""
    from ssdlocal.core.hostsync import Audit

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 40, generator=gen)  # [N, V]
    drafted = [None, 3, 0, 39, None, 5, 5]
    fans = [3, 1, 0, 5, 2, 4, 1]
    for params in (GREEDY, SAMPLED):
        audit = Audit()
        got = bonus_candidates_batch(logits, drafted, fans, params, audit.site("worker"))
        assert audit.snapshot()["worker"].reads == 1
        for i in range(7):
            score = logits[i] if params.greedy else torch.softmax(logits[i] / params.temperature, -1)
            order = [t for t in torch.argsort(score, descending=True).tolist() if t != drafted[i]]
            assert got[i] == order[: fans[i]], i
    assert bonus_candidates_batch(logits[:0], [], [], GREEDY) == []


def test_bonus_candidates_ordering_and_sizes():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen)
    order = torch.argsort(logits, descending=True).tolist()
    assert bonus_candidates(logits, None, 10, GREEDY) == order[:10]
    assert bonus_candidates(logits, order[0], 10, GREEDY) == order[1:11]
    # warped probabilities keep the logit order at T > 0
    assert bonus_candidates(logits, None, 10, SAMPLED) == order[:10]
    assert bonus_candidates(logits, order[4], 6, SamplingParams(temperature=0.5)) == (order[:4] + order[5:7])
    # fan-out 0 (or below) caches nothing
    assert bonus_candidates(logits, order[0], 0, GREEDY) == []
    assert bonus_candidates(logits, None, -3, SAMPLED) == []
    # fan-out beyond the vocabulary: every token but the drafted one
    assert sorted(bonus_candidates(logits, 7, 100, GREEDY)) == [t for t in range(50) if t != 7]
    assert len(bonus_candidates(logits, None, 100, GREEDY)) == 50


# ----------------------------------------------------------------- backup choice
def test_expected_rate_formula():
    # batch 2, h = 0.5: tokens = 2*(0.5*4 + 0.5*2) = 6; seconds = 1 + (1 - 0.25)*2 = 2.5
    assert expected_rate(2, 0.5, 4.0, 2.0, 1.0, 2.0) == pytest.approx(6 / 2.5)
    # a free backup costs nothing: tokens / verify time
    assert expected_rate(8, 0.3, 5.0, 1.0, 0.5, 0.0) == pytest.approx(8 * (1.5 + 0.7) / 0.5)
    assert expected_rate(1, 1.0, 3.0, 1.0, 0.0, 0.0) == 0.0  # no time: no rate


def _proposal(hits, backup, busy_s=0.0, prespec_s=0.0):
    return SimpleNamespace(cache_hit=tuple(hits), backup=backup, busy_s=busy_s, prespec_s=prespec_s)


def test_backup_chooser_fixed_policy():
    for policy in ("jit", "ngram", "none"):
        chooser = BackupChooser(policy, 4)
        chooser.observe_proposal(_proposal([False] * 64, "jit", busy_s=9.0))
        assert chooser.choose(64, 0.01) == policy
        assert chooser.choose(1, 10.0) == policy


def test_backup_chooser_auto_defaults_to_jit_until_timed():
    chooser = BackupChooser("auto", 4)
    assert chooser.choose(1, 0.1) == "jit"
    assert chooser.choose(256, 0.1) == "jit"  # no jit latency measured yet
    assert chooser.choose(0, 0.1) == "jit"


def test_backup_chooser_prefers_jit_at_batch_1_ngram_at_large_batch():
    chooser = BackupChooser("auto", 4)
    # a high hit rate, and a jit backup costing half a verification
    for _ in range(20):
        chooser.observe_proposal(_proposal([True] * 9 + [False], None))
    chooser.observe_proposal(_proposal([False], "jit", busy_s=0.6, prespec_s=0.1))
    assert chooser.jit_s == pytest.approx(0.5)
    assert chooser.hit_rate > 0.85
    assert chooser.choose(1, 1.0) == "jit"
    assert chooser.last == "jit"
    # with 64 rows almost every round has a miss somewhere: a free backup wins
    assert chooser.choose(64, 1.0) == "ngram"
    assert chooser.last == "ngram"
    # the crossover is monotone in batch size
    picks = [chooser.choose(b, 1.0) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    first_ngram = picks.index("ngram")
    assert all(p == "ngram" for p in picks[first_ngram:])


def test_backup_chooser_learns_tokens_and_jit_latency():
    chooser = BackupChooser("auto", 4)
    chooser.observe_proposal(_proposal([False], "jit", busy_s=1.0, prespec_s=0.0))
    chooser.observe_proposal(_proposal([False], "jit", busy_s=0.0, prespec_s=0.0))
    assert chooser.jit_s == pytest.approx(0.8)  # exponential average 0.8/0.2
    chooser.observe_proposal(_proposal([False], "jit", busy_s=0.1, prespec_s=0.5))
    assert chooser.jit_s == pytest.approx(0.64)  # busy below prespec clamps to 0
    before = chooser.tokens_ngram
    chooser.observe_tokens("ngram", 5.0)
    assert chooser.tokens_ngram == pytest.approx(0.9 * before + 0.5)
    # a cheap jit backup (5% of a verification) keeps jit even at batch 16 ...
    cheap = BackupChooser("auto", 4)
    cheap.observe_proposal(_proposal([False] * 4, "jit", busy_s=0.05))
    assert cheap.choose(16, 1.0) == "jit"
    # ... while an expensive jit backup loses to the free one already at batch 1
    costly = BackupChooser("auto", 4)
    costly.observe_proposal(_proposal([False], "jit", busy_s=50.0))
    assert costly.choose(1, 1.0) == "ngram"


# ----------------------------------------------------------------- CPU split
def test_split_cpus_needs_two():
    assert split_cpus(()) is None
    assert split_cpus([3]) is None


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 16, 64])
def test_split_cpus_disjoint_cover(n):
    cpus = list(range(100, 100 + n))
    plan = split_cpus(cpus)
    assert plan is not None
    assert set(plan.target_cpus).isdisjoint(plan.draft_cpus)
    assert sorted(plan.target_cpus + plan.draft_cpus) == cpus
    assert plan.draft_threads == max(1, n // 3) == len(plan.draft_cpus)
    assert plan.target_threads == n - plan.draft_threads >= 1
    assert plan.draft_cpus == tuple(cpus[-plan.draft_threads :])  # the draft takes the tail


def test_split_cpus_examples_and_share():
    plan = split_cpus([0, 1])
    assert plan.target_cpus == (0,) and plan.draft_cpus == (1,)
    plan = split_cpus([0, 2, 4, 6, 8, 10])
    assert plan.target_cpus == (0, 2, 4, 6) and plan.draft_cpus == (8, 10)
    plan = split_cpus(list(range(8)), draft_share=0.5)
    assert plan.target_cpus == (0, 1, 2, 3) and plan.draft_cpus == (4, 5, 6, 7)
    plan = split_cpus(list(range(8)), draft_share=0.0)  # at least one core for the draft
    assert plan.draft_cpus == (7,)


def test_planner_floor_defaults_to_one_candidate_per_length_and_cut_short_shrinks():
    planner = FanOutPlanner(3, budget=6)
    planner.observe_timing(prespec_s=0.1, verify_s=1.0, completed=False)  # cut short: shrink
    assert planner.budget == 5
    for _ in range(10):
        planner.observe_timing(prespec_s=0.5, verify_s=1.0, completed=False)
    assert planner.budget == 4  # K + 1


def test_tree_early_stop_waits_for_the_device_before_each_poll(monkeypatch):
    """A GPU queues the tree's steps asynchronously: the poll for the outcome must come after
    the previous step has run, or every step is queued before the first poll and the tree
    cannot be cut short. The speculator waits for the device before each poll."""
    import torch

    from ssdlocal.backends.base import SlotLayout
    from ssdlocal.core.config import SamplingParams
    from ssdlocal.draft.ssd import speculator as sp

    events: list[str] = []
    monkeypatch.setattr(sp, "wait_for_device", lambda t: events.append("wait"))

    class Runner:
        device, vocab_size = torch.device("cpu"), 10

        def tree_width(self, width):
            return width

        def tree_span(self, needed):
            return None

        def forward_raw(self, ids, positions, slots, mask, out=None):
            events.append("step")
            return kept_logits(torch.zeros(*ids.shape, 10), out)

    spec = object.__new__(sp.Speculator)
    spec.site = detached_site("worker")  # core.hostsync: counts nobody reads
    spec.runner, spec.k, spec.vocab = Runner(), 4, 10
    spec.params = SamplingParams()
    spec.layout = spec.full_layout = SlotLayout(16).with_tree(4, 4)
    spec.rows = [sp.RowState([1, 2, 3], [4, 5, 6, 7], None, {})]
    spec.cache = sp.SpeculationCache()
    spec.fixed_hit = spec.fixed_miss = (1, 1, 1, 1, 1)

    def should_stop():
        events.append("poll")
        return events.count("step") >= 2

    spec._tree_decode([[(0, None, 8), (1, None, 9)]], torch.zeros(0, 0, dtype=torch.long), 2, should_stop)
    assert events == ["step", "wait", "poll", "step", "wait", "poll"]
    assert spec.last_depth == 2


def _seeding_speculator(suffix: bool):
    """A Speculator over a fake runner: row [1, 2, 3, 4, 1, 2, 3] with drafts [5, 6]; the
    draft's logits favour token 7 everywhere, the row's own history says 4 follows 2, 3."""
    import torch

    from ssdlocal.core.config import SamplingParams
    from ssdlocal.draft.ssd import speculator as sp
    from ssdlocal.speculation.suffix import SuffixIndex, SuffixMemory

    class Runner:
        device, vocab_size = torch.device("cpu"), 10

        def pending(self, b, tokens):
            return []

        def cached(self, b):
            return 9

        def feed(self, feeds, logits="all"):
            return [torch.zeros(0, 10) for _ in feeds]

    spec = object.__new__(sp.Speculator)
    spec.site = detached_site("worker")  # core.hostsync: counts nobody reads
    spec.runner, spec.k, spec.vocab, spec.params = Runner(), 2, 10, SamplingParams()
    spec.max_branches, spec.fixed_hit, spec.fixed_miss = 32, (1, 1, 1), (1, 1, 1)
    spec.cache = sp.SpeculationCache()
    seq = [1, 2, 3, 4, 1, 2, 3]
    favour_7 = torch.zeros(10)
    favour_7[7] = 5.0
    spec.rows = [sp.RowState(seq, [5, 6], None, {len(seq) + j: favour_7 for j in range(3)})]
    spec.suffix = None
    if suffix:
        spec.suffix = object.__new__(sp.SuffixBackup)
        spec.suffix.memory, spec.suffix.own = SuffixMemory(), [SuffixIndex(seq)]
        spec.suffix.min_confidence = 0.3
    seen = []

    def tree(branches, cands, width, should_stop=None):  # each branch as (k, bonus), bonus from the device
        flat = cands.reshape(-1).tolist()
        seen.append([[(k, token if pick is None else flat[pick]) for k, pick, token in todo] for todo in branches])

    spec._tree_decode = tree
    return spec, seen


def test_the_suffix_backup_seeds_a_branch_the_draft_would_not_cache():
    spec, seen = _seeding_speculator(suffix=True)
    spec.prespeculate()
    # accepted 0: the draft's best (7) and the suffix's guess (4, what followed 2, 3 before);
    # accepted 1 and 2: contexts ending 3, 5 and 5, 6 match nothing, so the draft's only
    (branches,) = seen  # one tree; one row
    assert branches == [[(0, 7), (0, 4), (1, 7), (2, 7)]]
    spec, seen = _seeding_speculator(suffix=False)
    spec.prespeculate()
    assert seen == [[[(0, 7), (1, 7), (2, 7)]]]


def test_one_read_per_prespeculation_and_a_seed_among_the_candidates_is_dropped():
    """The candidates stay on the device: a whole pre-speculation (top-k, tree, cache) reads
    the host once, the tree's bonuses with its drafts. A suffix seed the draft also ranks
    first (4 at accepted length 0) is decoded once more and dropped when cached: the draft's
    branch (scratch run 0) wins, and every cached branch's bonus is what the draft ranked."""
    import torch

    from ssdlocal.backends.base import SlotLayout
    from ssdlocal.core.hostsync import Audit

    spec, _ = _seeding_speculator(suffix=True)
    del spec._tree_decode  # the real tree, over a fake forward
    audit = Audit()
    spec.site = audit.site("worker")
    spec.layout = spec.full_layout = SlotLayout(16).with_tree(8, spec.k)
    for j, token in enumerate((4, 7, 7)):  # accepted 0: the draft ranks 4 first (the suffix guess too)
        spec.rows[0].pred[7 + j] = torch.nn.functional.one_hot(torch.tensor(token), 10).float() * 5
    steps = []

    class Runner(type(spec.runner)):
        def tree_width(self, width):
            return width

        def tree_span(self, needed):
            return None

        def forward_raw(self, ids, positions, slots, mask, out=None):  # next token: id + 1 (mod 10)
            steps.append(ids.clone())
            return kept_logits(torch.nn.functional.one_hot((ids + 1) % 10, 10).float(), out)  # [B, W, V]

    spec.runner = Runner()
    spec.prespeculate()
    assert steps[0].tolist() == [[4, 4, 7, 7]]  # draft's 4, the seed 4, then accepted 1 and 2
    assert audit.snapshot()["worker"].reads == 1
    assert sorted(spec.cache.keys()) == [(0, 0, 4), (0, 1, 7), (0, 2, 7)]
    kept = spec.cache.get(0, 0, 4)
    assert kept.slot_start == spec.layout.scratch(0) and kept.tokens == (5, 6)
    assert spec.cache.get(0, 2, 7).slot_start == spec.layout.scratch(3)
