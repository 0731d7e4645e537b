"""A drafter that reads the target's hidden states is a new drafter and a row in the table:
this test adds one (a fake head: its own draft type, its drafter, one BUILDERS row) without
touching the package, and holds the engine to the contract: the drafter gets the target's
final hidden states at the prompt's last position (`start`) and at every scored position of
every round (`RoundOutcome.hidden`), equal to what the target's own forward computes there,
eager and in traced graphs (captured steps write a registered static buffer), and greedy
output stays AR's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from ssdlocal.backends.base import FINAL_HIDDEN
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.draft import factory
from ssdlocal.draft.base import DrafterBase, Proposal
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    if n < 2:"]


@dataclass(frozen=True)
class HeadDraft:
    """The fake head's draft type (a real head would name its weights here)."""

    kind: ClassVar[str] = "head"
    model: ClassVar[None] = None
    label: ClassVar[str] = "fake head"
    word: ClassVar[None] = None


class HeadDrafter(DrafterBase):
    """Proposes K tokens per row from the hidden state of the row's last verified position:
    the argmax of a fixed projection, repeated (a point mass, verified as such). Keeps every
    hidden state it was handed, with the row tokens they belong to."""

    hidden = (FINAL_HIDDEN,)

    def __init__(self, k: int, width: int, vocab: int, device) -> None:
        self.k, self.device = k, device
        self.project = torch.randn(width, vocab, generator=torch.Generator().manual_seed(0))  # [D, V]
        self.seen: list[tuple[list[int], torch.Tensor]] = []  # (tokens through the state's position, state [D])
        self.rows = ()
        self.states: torch.Tensor | None = None  # [B, D]: each row's newest verified state

    def start(self, rows, hidden=None) -> None:
        assert hidden is not None and hidden.states.shape[0] == len(rows)  # PromptHidden: every read position
        self.rows = rows
        last = torch.tensor([n - 1 for n in hidden.fed])
        self.states = hidden.states[torch.arange(len(rows)), last].float().clone()  # [B, D]: the prompts' ends
        for b, row in enumerate(rows):
            for j in range(hidden.fed[b]):  # column j: position start[b] + j
                self.seen.append((row.tokens[: hidden.start[b] + j + 1], hidden.states[b, j].float().clone()))

    def propose(self, active) -> Proposal:
        guess = (self.states @ self.project).argmax(-1).tolist()  # [B]
        tokens = [[g] * self.k if on else [] for g, on in zip(guess, active)]
        return Proposal.from_lists(tokens, self.k, self.device)

    def observe(self, outcome) -> None:
        assert outcome.hidden is not None  # [B, T, D]: every scored position of the round
        for b, row in enumerate(self.rows):
            if not outcome.appended[b]:
                continue
            n = outcome.n_accepted[b]
            if len(outcome.appended[b]) != n + 1:
                continue  # cut by a stopping rule: the row ends here
            before = row.length - n - 1  # the row's tokens before the round
            for j in range(n + 1):  # the pending token and the accepted drafts were scored
                self.seen.append((row.tokens[: before + j], outcome.hidden[b, j].float().clone()))
            self.states[b] = outcome.hidden[b, n].float()


def _build(spec, params, res):
    drafter = HeadDrafter(spec.k, res.hidden_size, res.target_vocab, res.target_device)
    _build.made.append(drafter)
    return drafter


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_a_head_drafter_reads_the_targets_hidden_states_and_output_stays_ar(tiny_dir, monkeypatch, graphs):
    monkeypatch.setitem(factory.BUILDERS, HeadDraft, _build)
    _build.made = []
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), graphs=graphs)
    head = SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft())
    with Engine(config) as engine:
        ar = [e for e in engine.generate(PROMPTS, GREEDY, spec=SpecConfig(mode=Mode.AR)) if isinstance(e, DoneEvent)]
        sd = [e for e in engine.generate(PROMPTS, GREEDY, spec=head) if isinstance(e, DoneEvent)]
        assert [o.token_ids for o in sd[0].outputs] == [o.token_ids for o in ar[0].outputs]
        assert sd[0].stats.rounds > 0 and sd[0].stats.acceptance_rate is not None
        drafter = _build.made[-1]
        model = engine.runner.model
        assert len(drafter.seen) > len(PROMPTS)
        for tokens, state in drafter.seen:  # each state equals the target's own at that position
            ids = torch.tensor([tokens])
            positions = torch.arange(len(tokens))[None]
            engine.runner.reset(1, 64)
            with torch.inference_mode():
                _, want = model(ids, positions, positions, None, None, (FINAL_HIDDEN,))
            torch.testing.assert_close(state, want[0, -1].float(), rtol=1e-4, atol=1e-4)
        if graphs == "trace":
            assert sd[0].stats["graphs"]["target"]["replays"] > 0  # the steps that wrote them were replayed


def test_a_backend_without_hidden_states_refuses_a_head_with_a_hint(tiny_dir):
    from ssdlocal.backends.base import HeldRows
    from ssdlocal.core.errors import UsageError

    class NoHidden(HeldRows):
        held = []

    NoHidden().keep_hidden(None)  # nothing asked: fine
    with pytest.raises(UsageError, match="cannot give a drafter the target's hidden states") as info:
        NoHidden().keep_hidden((FINAL_HIDDEN,))
    assert "--target-backend torch" in info.value.hint
