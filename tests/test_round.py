"""engine/round.py's Round on a scripted runner (support/scripted.py): no model, milliseconds.

The target is a table (the next token is a function of the last two), the drafter another
table that is wrong at chosen places, so every round's accepted count is known in advance.
After every round the target's cache must hold exactly the row's committed tokens up to
the runner's `cached` count (which commit moves with host counts that must equal the
device's), and the tokens taken must be the table's own continuation (exactness);
`test_a_wrong_accept_count_is_caught` breaks verification on purpose and checks that this
harness notices.
"""

from __future__ import annotations

import torch
import pytest

import ssdlocal.core.verify as verify_module
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import RoundEvent, TokensEvent
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.sequence import Row
from ssdlocal.core.verify import Verdict
from ssdlocal.engine.prefill import read_prompts
from ssdlocal.engine.round import Round
from ssdlocal.engine.shape import Shaper
from support.scripted import Names, ScriptedRunner, TableDrafter, follow, sampling_of, seating_of

V = 16
EOS = 15


def target_next(tokens) -> int:
    """The target's greedy choice after `tokens` (never EOS unless a test's table says so)."""
    return (3 * tokens[-1] + tokens[-2] + 1) % 14


def wrong_every(n: int):
    """A draft table that agrees with the target except at every n-th row length."""
    return lambda tokens: target_next(tokens) if len(tokens) % n else (target_next(tokens) + 1) % 14


def continuation(prompt, n, next_token=target_next) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def start(prompts, budgets, drafter=None, k=0, params=None, next_token=target_next, audit=None):
    """Rows, runner and Round after read_prompts, as the engine builds them."""
    params = params or SamplingParams(temperature=0.0, max_new_tokens=None)
    runner = ScriptedRunner(follow(next_token, V), V)
    runner.setup_prefix(0)
    runner.reset(len(prompts), max(map(len, prompts)) + max(budgets) + k + 2)
    rows = [Row(list(p), params, frozenset({EOS}), Names(), budget=n) for p, n in zip(prompts, budgets)]
    seating = seating_of(runner, rows, sampling_of(params, len(rows)), drafter, k, audit=audit)
    first, _ = read_prompts(seating, CancelToken())
    if drafter is not None:
        drafter.start(rows)
    rnd = Round(seating, first)
    return runner, rows, rnd


def run_checked(runner, rows, rnd, max_rounds=50) -> list:
    """Every round until the rows finish; in each, the step's bound covers every live row's
    writes; after each, the target's cache holds each row's first `cached` tokens, its step
    lengths equal `cached`, and `last` is the newest token."""
    events = []
    for index in range(max_rounds):
        if not any(r.active for r in rows):
            return events
        live = [b for b, r in enumerate(rows) if r.active]
        events.extend(rnd.run(index))
        assert runner.steps[-1].bound_covers(live), "the step's bound cuts a live row's attention"
        for b, row in enumerate(rows):
            n = runner.cached(b)
            assert runner.lengths[b] == n, f"row {b}: cache length {runner.lengths[b]} != {n}"
            assert runner.cache_holds(b, row.tokens[:n]), f"row {b}: the cache holds a rejected draft"
            assert n == row.length - 1 or not row.active
        assert rnd.last.tolist()[0] == rows[0].tokens[-1] or not rows[0].active
    raise AssertionError("the rows did not finish")


def test_a_round_takes_the_accepted_drafts_then_the_bonus():
    prompt = [1, 2, 3]
    drafter = TableDrafter(wrong_every(6), k=3)  # 4 tokens after the first: d1, d2 right, d3 (at 6) wrong
    runner, rows, rnd = start([prompt], [20], drafter, k=3)
    expected = continuation(prompt, 5)
    assert rows[0].generated == expected[:1]
    events = list(rnd.run(0))
    tokens, done = events[0], events[-1]
    assert isinstance(tokens, TokensEvent) and isinstance(done, RoundEvent)
    assert done.n_drafted == (3,) and done.n_accepted == (2,) and done.n_emitted == (3,)
    assert tokens.token_ids == tuple(expected[1:4]) and tokens.origins == ("draft", "draft", "target")
    assert runner.cached(0) == len(prompt) + 3 and runner.lengths == [len(prompt) + 3]
    assert runner.cache_holds(0, rows[0].tokens[:-1])
    (outcome,) = drafter.outcomes
    assert outcome.n_accepted == (2,) and outcome.appended == (tuple(expected[1:4]),) and outcome.active == (True,)


@pytest.mark.parametrize("k, wrong", [(1, 3), (3, 4), (4, 5), (5, 2)])
def test_speculative_rounds_give_the_targets_tokens(k, wrong):
    prompts, budgets = [[1, 2, 3], [4, 5, 6, 7, 8]], [17, 9]
    runner, rows, rnd = start(prompts, budgets, TableDrafter(wrong_every(wrong), k), k=k)
    events = run_checked(runner, rows, rnd)
    for prompt, n, row in zip(prompts, budgets, rows):
        assert row.generated == continuation(prompt, n) and row.finish_reason == "length"
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert sum(sum(r.n_emitted) for r in rounds) == sum(budgets) - len(prompts)  # the first tokens came from prefill
    assert all(a <= d for r in rounds for a, d in zip(r.n_accepted, r.n_drafted))


def test_plain_rounds_take_one_token_each():
    prompt = [2, 9, 4]
    runner, rows, rnd = start([prompt], [6])
    events = run_checked(runner, rows, rnd)
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert rows[0].generated == continuation(prompt, 6)
    assert len(rounds) == 5 and all(r.n_drafted == (0,) and r.n_emitted == (1,) for r in rounds)
    assert runner.calls["step"] == 5


def test_a_wrong_accept_count_is_caught(monkeypatch):
    """The harness above fails when verification accepts one draft too many."""
    real = verify_module.verify_logits

    def one_too_many(*args, **kwargs) -> Verdict:
        verdict = real(*args, **kwargs)
        return Verdict(torch.clamp(verdict.n_accepted + 1, max=args[1].shape[1]), verdict.bonus)

    monkeypatch.setattr(verify_module, "verify_logits", one_too_many)
    runner, rows, rnd = start([[1, 2, 3]], [12], TableDrafter(wrong_every(3), 3), k=3)
    with pytest.raises(AssertionError):
        run_checked(runner, rows, rnd)
        assert rows[0].generated == continuation([1, 2, 3], 12)


def test_a_finished_row_stops_while_the_other_goes_on():
    prompts = [[1, 2, 3], [3, 1, 4]]
    runner, rows, rnd = start(prompts, [3, 12], TableDrafter(wrong_every(5), 2), k=2)
    events = run_checked(runner, rows, rnd)
    assert rows[0].generated == continuation(prompts[0], 3) and rows[1].generated == continuation(prompts[1], 12)
    assert runner.lengths[0] == runner.cached(0) < len(prompts[0]) + 3  # its length stopped when it finished
    later = [e for e in events if isinstance(e, RoundEvent) and 0 not in e.rows]
    assert later and all(e.rows == (1,) for e in later)
    assert not any(isinstance(e, TokensEvent) and e.row == 0 and e.token_ids == () for e in events)


def test_drafts_after_eos_are_not_taken():
    table = lambda tokens: EOS if len(tokens) == 6 else target_next(tokens)  # noqa: E731
    runner, rows, rnd = start([[1, 2, 3]], [20], TableDrafter(table, 4), k=4, next_token=table)
    run_checked(runner, rows, rnd)
    assert rows[0].finish_reason == "eos" and rows[0].generated[-1] == EOS and len(rows[0].generated) == 4


def test_one_host_read_per_round():
    audit = Audit()
    runner, rows, rnd = start([[1, 2, 3]], [9], TableDrafter(wrong_every(4), 3), k=3, audit=audit)
    before = audit.snapshot()
    rounds = [e for e in run_checked(runner, rows, rnd) if isinstance(e, RoundEvent)]
    assert audit.since(before)["target"].reads == len(rounds)


def test_sampled_rounds_give_what_plain_rounds_give_for_one_seed():
    """At temperature 1 a drafter proposing the target's argmax changes which random numbers
    verification draws, not the rule: with a point-mass draft the tokens are the target's
    distribution either way, and the cache invariant holds every round."""
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=None)
    runner, rows, rnd = start([[1, 2, 3], [5, 5, 5]], [15, 15], TableDrafter(target_next, 3), k=3, params=params)
    run_checked(runner, rows, rnd)
    assert all(len(r.generated) == 15 for r in rows)


def test_logprobs_are_the_targets_at_the_tokens_taken():
    params = SamplingParams(temperature=0.0, max_new_tokens=None, logprobs=2)
    runner, rows, rnd = start([[1, 2, 3]], [8], TableDrafter(wrong_every(5), 3), k=3, params=params)
    rnd.shaper = Shaper(logprobs=2)
    events = [e for e in run_checked(runner, rows, rnd) if isinstance(e, TokensEvent)]
    row = rows[0]
    position = len(row.prompt) + 1  # the first token came from the prefill
    for event in events:
        for token, lp in zip(event.token_ids, event.logprobs):
            expected = torch.log_softmax(follow(target_next, V)(row.tokens[:position]), -1)
            assert lp.token == token and lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
            assert lp.top[0][0] == token and len(lp.top) == 2
            position += 1
    assert position == row.length
