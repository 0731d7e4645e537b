"""engine/shape.py's Shaper between the target's logits and verification, on a scripted runner
(support/scripted.py) with a scripted grammar: every row may emit only tokens of one parity,
so the masks, the first token's mask and a grammar's view of the drafts are checked without
llguidance. Real grammars run the same Shaper in test_grammar.py and test_constrained_*.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import RoundEvent, TokensEvent
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.sequence import Request, Row
from ssdlocal.engine.prefill import read_prompts
from ssdlocal.engine.round import Round
from ssdlocal.engine.shape import Shaper
from support.scripted import Names, ScriptedRunner, TableDrafter, sampling_of, seating_of

V = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None)


def prefers(tokens) -> int:
    """The target's favourite: any parity. Its second choice (ranked below) is the next token."""
    return (tokens[-1] * 7 + len(tokens)) % V


def ranked(tokens) -> torch.Tensor:
    """Logits with a strict order: prefers(tokens) first, then prefers + 1, + 2, ... (mod V)."""
    top = prefers(tokens)
    return torch.tensor([float(V - (t - top) % V) for t in range(V)])


class Parity:
    """A grammar.guide.Guides stand-in: row b may emit only tokens of parity `parity[b]`
    (None: unconstrained). It records what it was asked and what it committed."""

    def __init__(self, parity) -> None:
        self.parity = parity
        self.constrained = [p is not None for p in parity]
        self.committed: list[list[int]] = [[] for _ in parity]
        self.asked_widths: list[int] = []

    def timing(self, active):
        return contextlib.nullcontext()

    def allowed(self, drafts, width, active, device) -> torch.Tensor:
        self.asked_widths.append(width)
        ok = torch.ones(len(self.parity), width + 1, V, dtype=torch.bool)
        for b, p in enumerate(self.parity):
            if p is not None:
                ok[b, :, [t for t in range(V) if t % 2 != p]] = False
        return ok  # [B, width + 1, V]

    def commit(self, emitted, active) -> None:
        for b, tokens in enumerate(emitted):
            if active[b]:
                self.committed[b].extend(tokens)

    def errors(self) -> dict:
        return {}

    def take_seconds(self) -> list[float]:
        return [0.0] * len(self.parity)


def best_allowed(tokens, parity) -> int:
    order = [(prefers(tokens) + i) % V for i in range(V)]
    return next(t for t in order if parity is None or t % 2 == parity)


def call(prompts, parity, drafter=None, k=0, budget=8, audit=None):
    runner = ScriptedRunner(ranked, V)
    runner.reset(len(prompts), max(map(len, prompts)) + budget + k + 2)
    rows = [Row(list(p), GREEDY, frozenset(), Names(), budget=budget) for p in prompts]
    audit = audit or Audit()
    shaper = Shaper(Parity(parity), None, audit)
    seating = seating_of(runner, rows, sampling_of(GREEDY, len(rows)), drafter, k, shaper=shaper, audit=audit)
    first, _ = read_prompts(seating, CancelToken())
    if drafter is not None:
        drafter.start(rows)
    rnd = Round(seating, first)
    events = []
    for index in range(40):
        if not any(r.active for r in rows):
            break
        events.extend(rnd.run(index))
    return rows, shaper.guides, events


def expected(prompt, parity, n) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(best_allowed(tokens, parity))
    return tokens[len(prompt) :]


def test_every_token_is_the_best_one_its_grammar_allows():
    prompts, parity = [[1, 2, 3], [4, 5], [6, 7, 8]], [0, 1, None]
    rows, guides, _ = call(prompts, parity)
    for prompt, p, row in zip(prompts, parity, rows):
        assert row.generated == expected(prompt, p, 8)
    assert [g for g in guides.committed] == [r.generated for r in rows]  # the matchers followed the rows
    assert not all(t % 2 == 0 for t in rows[2].generated)  # unconstrained: the target's own choices


@pytest.mark.parametrize("k", [2, 3])
def test_drafts_the_grammar_forbids_are_rejected(k):
    """A drafter proposing the target's unconstrained favourites: those of the wrong parity
    are rejected, the tokens taken are the constrained ones all the same."""
    prompts, parity = [[1, 2, 3], [9, 9, 9]], [0, None]
    rows, guides, events = call(prompts, parity, TableDrafter(prefers, k), k)
    for prompt, p, row in zip(prompts, parity, rows):
        assert row.generated == expected(prompt, p, 8)
    assert set(guides.asked_widths) <= {0, k} and k in guides.asked_widths
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert any(n < d for r in rounds for n, d in zip(r.n_accepted, r.n_drafted))


def test_drafts_reach_the_grammar_once_per_round():
    """Drafts the drafter hands over as host lists cost no read; the round's verdict is its one."""
    audit = Audit()
    before = audit.snapshot()
    rows, _, events = call([[1, 2, 3]], [1], TableDrafter(prefers, 2), 2, audit=audit)
    rounds = [e for e in events if isinstance(e, RoundEvent)]
    assert audit.since(before)["target"].reads == len(rounds) + 1  # + the first token


def test_a_shaper_for_rows_without_grammars_builds_nothing_and_asks_the_most_logprobs():
    rows = [
        Row([1], SamplingParams(logprobs=lp), frozenset(), Names(), request=Request((1,), SamplingParams(logprobs=lp)))
        for lp in (3, None, 1)
    ]
    shaper = Shaper.for_rows(rows, V, {0})
    assert shaper.guides is None and shaper.logprobs == 3
    assert all(row.guide is None for row in rows)
    assert Shaper.for_rows(rows[1:2], V, {0}).logprobs is None
    logits = torch.randn(2, 3, V)
    assert shaper.mask(logits, "proposal", [True, True]) == (logits, "proposal")
    assert shaper.seconds([0, 1]) == (None, None)


def test_tokens_events_carry_the_rows_tokens():
    rows, _, events = call([[1, 2, 3]], [0])
    taken = [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids]
    assert [rows[0].generated[0]] + taken == rows[0].generated
