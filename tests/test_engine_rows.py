"""Per-row control of one generate call: `Engine.cancel_rows` stops some rows while the
others go on unchanged, and `max_new_tokens=None` gives each row the rest of the
model's context (its own, whatever the other prompts' lengths).

Events carry what the server needs per row: TokensEvent.finish_reason on a row's last
tokens and RoundEvent.rows naming the row of each per-row entry.
"""

from __future__ import annotations

import pytest

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent, RoundEvent, TokensEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def foo(x):"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module", params=["ar", "sd", "ssd"])
def engine(request, tiny_dir):
    mode = Mode(request.param)
    draft = None if mode is Mode.AR else str(tiny_dir["draft_llama"])
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=mode, k=3, draft=draft_of(draft)),
        pin_cpus=False,
    )
    with Engine(config) as eng:
        yield eng


def _collect(engine: Engine, prompts, params, on_event=None):
    events = []
    for ev in engine.generate(prompts, params):
        events.append(ev)
        if on_event is not None:
            on_event(ev)
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done, events


def test_cancel_rows_stops_only_those_rows(engine):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone, _ = _collect(engine, PROMPTS[:1], params)
    cancelled = []

    def cancel_row_1(ev) -> None:
        if isinstance(ev, TokensEvent) and ev.row == 1 and not cancelled:
            engine.cancel_rows([1])
            cancelled.append(True)

    done, events = _collect(engine, PROMPTS[:2], params, cancel_row_1)
    assert done.outputs[1].finish_reason == "cancelled"
    assert len(done.outputs[1].token_ids) < 40
    # row 0 is untouched: same tokens as when it ran alone
    assert done.outputs[0].token_ids == alone.outputs[0].token_ids
    assert done.outputs[0].finish_reason == "length"
    # after the cancel, no round lists row 1 and no tokens reach it
    first_cancel = next(i for i, ev in enumerate(events) if isinstance(ev, TokensEvent) and ev.row == 1)
    later_rounds = [ev for ev in events[first_cancel + 1 :] if isinstance(ev, RoundEvent)]
    assert later_rounds and all(1 not in ev.rows for ev in later_rounds[1:])
    # a cancel is for the running call only: the next call runs every row to the end
    engine.cancel_rows([0])
    again, _ = _collect(engine, PROMPTS[:1], params)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_events_name_rows_and_finish_reasons(engine):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    _, events = _collect(engine, PROMPTS, params)
    finishes = {ev.row: ev.finish_reason for ev in events if isinstance(ev, TokensEvent) and ev.finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    for ev in events:
        if isinstance(ev, RoundEvent):
            assert len(ev.rows) == len(ev.n_accepted) == len(ev.n_drafted)
    per_row = {
        b: sum(len(ev.token_ids) for ev in events if isinstance(ev, TokensEvent) and ev.row == b) for b in range(3)
    }
    assert per_row == {0: 12, 1: 12, 2: 12}


def test_no_max_new_tokens_fills_each_rows_context(engine):
    params = SamplingParams(max_new_tokens=None, ignore_eos=True)
    ids = [engine.encode(p, chat=False) for p in PROMPTS[:2]]
    done, _ = _collect(engine, ids, params)
    context = engine.context
    for prompt, out in zip(ids, done.outputs):
        assert out.finish_reason == "length"
        assert len(prompt) + len(out.token_ids) == context  # each row its own budget


def test_prompt_too_long_for_the_context_is_a_usage_error(engine):
    long_prompt = list(range(5, 5 + engine.context))
    with pytest.raises(UsageError, match="context is"):
        list(engine.generate([long_prompt], SamplingParams(max_new_tokens=None)))
    with pytest.raises(UsageError, match="needs"):
        list(engine.generate([long_prompt[:100]], SamplingParams(max_new_tokens=engine.context)))
