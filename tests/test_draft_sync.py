"""draft/sync.py's drafters wired to engine/round.py on scripted runners (support/scripted.py):
the draft model's cache follows the rows round after round (catch-up, K-1 kept after an
all-accepted round, nothing kept past a rejection), its drafts are its own table's greedy
continuation, and the tokens taken are the target's. Real tiny models run the same drafters
end to end in test_engine_exact.py."""

from __future__ import annotations

import pytest

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.models import NgramDraft
from ssdlocal.core.sequence import Row
from ssdlocal.draft.decode import Drafting
from ssdlocal.draft.sync import CATCH_UP, ModelDrafter, NgramDrafter
from ssdlocal.engine.prefill import read_prompts
from ssdlocal.engine.round import Round
from support.scripted import Names, ScriptedRunner, follow, sampling_of, seating_of

V = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None)


def target_next(tokens) -> int:
    return (3 * tokens[-1] + tokens[-2] + 1) % V


def draft_next(tokens) -> int:
    """The draft's table: the target's, wrong at every fifth length."""
    return target_next(tokens) if len(tokens) % 5 else (target_next(tokens) + 1) % V


def continuation(prompt, n, next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def sd_call(prompts, budgets, k):
    """Target and draft runners, the rows, the ModelDrafter and the Round after prefill."""
    slots = max(map(len, prompts)) + max(budgets) + k + 2
    target = ScriptedRunner(follow(target_next, V), V)
    target.reset(len(prompts), slots)
    draft = ScriptedRunner(follow(draft_next, V), V)
    drafter = ModelDrafter(Drafting(draft, k, GREEDY, V), "cpu")
    drafter.reserve(len(prompts), slots)
    rows = [Row(list(p), GREEDY, frozenset(), Names(), budget=n) for p, n in zip(prompts, budgets)]
    seating = seating_of(target, rows, sampling_of(GREEDY, len(rows)), drafter, k)
    first, _ = read_prompts(seating, CancelToken())
    drafter.start(rows)
    rnd = Round(seating, first)
    return draft, drafter, rows, rnd


def run_checked(draft, drafter, rows, rnd) -> int:
    """Rounds until the rows finish; checks each proposal against the draft's table and the
    draft's cache against the rows after each round. Returns the rounds run."""
    proposals = []
    propose = drafter.propose
    drafter.propose = lambda active, k=None: proposals.append(propose(active, k)) or proposals[-1]
    for index in range(60):
        if not any(r.active for r in rows):
            return index
        before = [list(r.tokens) for r in rows]
        list(rnd.run(index))
        drafted = proposals[-1].drafts.tolist()
        for b, row in enumerate(rows):
            if row.active or len(row.tokens) > len(before[b]):
                assert drafted[b] == continuation(before[b], drafter.k, draft_next), (
                    f"row {b}: not the draft's own drafts"
                )
            assert draft.lengths[b] == drafter.cached[b], (
                f"row {b}: draft length {draft.lengths[b]} != {drafter.cached[b]}"
            )
            assert draft.cache_holds(b, row.tokens[: drafter.cached[b]]), f"row {b}: the draft keeps a rejected draft"
    raise AssertionError("the rows did not finish")


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_model_drafts_follow_the_rows_and_the_target_decides(k):
    prompts, budgets = [[1, 2, 3], [9, 8, 7, 6, 5, 4]], [19, 11]
    draft, drafter, rows, rnd = sd_call(prompts, budgets, k)
    rounds = run_checked(draft, drafter, rows, rnd)
    for prompt, n, row in zip(prompts, budgets, rows):
        assert row.generated == continuation(prompt, n, target_next)
    if k > 1:
        assert rounds < max(budgets)  # drafts were accepted: fewer rounds than tokens


def test_the_draft_reads_the_prompts_once_when_first_asked():
    """Nothing of the draft's happens before its first proposal, its cache included (K per
    round may never ask; a llama.cpp context of 33k cells took 1.6 s to make); then it is
    made once, for the shape reserved, and the prompt read once."""
    draft, drafter, rows, rnd = sd_call([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], [4], 3)
    assert draft.calls["feed"] == 0 and draft.calls["reset"] == 0  # nothing before the first proposal
    run_checked(draft, drafter, rows, rnd)
    assert draft.calls["feed"] == 1 and draft.calls["begin_steps"] == 1 and draft.calls["reset"] == 1
    assert draft.num_slots == 11 + 4 + 3 + 2 + CATCH_UP  # sd_call's slots, with a catch-up chunk's room


def test_keeping_one_draft_too_many_is_caught(monkeypatch):
    """The harness above fails when the drafter keeps a token past what was verified."""
    real = ModelDrafter.observe

    def greedy_keep(self, outcome, adopted=None):
        real(self, outcome, adopted)
        self.runner.advance(1)
        self.cached = [c + 1 for c in self.cached]
        self._fed = list(self.cached)

    monkeypatch.setattr(ModelDrafter, "observe", greedy_keep)
    draft, drafter, rows, rnd = sd_call([[1, 2, 3]], [15], 3)
    with pytest.raises(AssertionError):
        run_checked(draft, drafter, rows, rnd)


def test_ngram_proposals_pad_to_the_longest_and_skip_idle_rows():
    rows = [Row(p, GREEDY, frozenset(), Names(), budget=4) for p in ([1, 2, 3, 1, 2], [5, 6, 7, 8], [4, 4, 4, 4])]
    drafter = NgramDrafter(3, NgramDraft(n_max=2, n_min=1))
    drafter.start(rows)
    proposal = drafter.propose([True, True, False])
    assert proposal.tokens[0][:1] == [3] and proposal.tokens[1] == [] and proposal.tokens[2] == []
    assert proposal.n_draft.tolist() == [len(proposal.tokens[0]), 0, 0]
    assert proposal.drafts.shape == (3, len(proposal.tokens[0])) and proposal.q is None
