"""engine/prefill.py on a scripted runner (support/scripted.py): read_prompts' first token,
prefix reuse, progress and cancel, and store_prefixes after a call. The same module on real
tiny checkpoints (chunked feeds against one long feed, prompts past a chunk) is in
test_prefill.py."""

from __future__ import annotations

import pytest

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sequence import Row
from ssdlocal.engine.prefill import PrefillStopped, read_prompts, store_prefixes
from ssdlocal.engine.round import Round
from support.scripted import Names, ScriptedRunner, follow, sampling_of, seating_of

V = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def next_token(tokens) -> int:
    return (tokens[-1] * 5 + len(tokens)) % V


def runner_for(batch: int, slots: int = 64, chunk: int = 8, prefix: int = 256) -> ScriptedRunner:
    runner = ScriptedRunner(follow(next_token, V), V, chunk=chunk)
    runner.setup_prefix(prefix)
    runner.reset(batch, slots)
    return runner


def rows_of(prompts) -> list[Row]:
    return [Row(list(p), GREEDY, frozenset(), Names()) for p in prompts]


def read(runner, rows, token=None, progress=None):
    return read_prompts(seating_of(runner, rows, sampling_of(GREEDY, len(rows))), token or CancelToken(), progress)


def test_the_first_token_follows_each_prompt():
    prompts = [[1, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1]]
    runner, rows = runner_for(2), rows_of(prompts)
    first, event = read(runner, rows)
    assert first.tolist() == [next_token(p) for p in prompts]
    assert [r.generated for r in rows] == [[next_token(p)] for p in prompts]
    assert runner.held == prompts and runner.lengths == [len(p) for p in prompts]  # in step mode, first not cached
    assert event.rows == 2 and event.prompt_tokens == (3, 11) and event.cached_tokens == (0, 0)
    assert runner.calls["feed"] == 1 and runner.calls["begin_steps"] == 1


def test_a_stored_prefix_is_reused_in_whole_blocks():
    earlier = list(range(1, 11))  # 10 tokens: two whole blocks of 4 are stored
    runner = runner_for(1)
    runner.feed([earlier], "none")
    runner.store(0, earlier)
    runner.reset(1, 64)
    prompt = earlier[:9] + [3, 3]
    rows = rows_of([prompt])
    first, event = read(runner, rows)
    assert event.cached_tokens == (8,)
    assert first.tolist() == [next_token(prompt)] and runner.held == [prompt]


def test_the_last_prompt_token_is_always_fed():
    """A prompt the store holds whole still feeds its last token: its logits give the first."""
    prompt = list(range(1, 9))
    runner = runner_for(1)
    runner.feed([prompt], "none")
    runner.store(0, prompt)
    runner.reset(1, 64)
    first, event = read(runner, rows_of([prompt]))
    assert event.cached_tokens == (4,) and first.tolist() == [next_token(prompt)]


def test_a_cancel_stops_the_read_with_nothing_kept():
    prompt = list(range(20))
    runner, rows, token, seen = runner_for(1), rows_of([prompt]), CancelToken(), []

    def progress(p):
        seen.append((p.done, p.total))
        token.cancel()

    with pytest.raises(PrefillStopped):
        read(runner, rows, token, progress)
    assert seen == [(8, 20)]  # one chunk read, then the cancel is seen before the next
    assert runner.held == [[]] and rows[0].generated == []


def test_store_prefixes_keeps_what_the_cache_holds_after_rounds():
    prompt = [3, 1, 4, 1, 5]
    runner, rows = runner_for(1), rows_of([prompt])
    seating = seating_of(runner, rows, sampling_of(GREEDY, 1))
    first, _ = read_prompts(seating, CancelToken())
    rnd = Round(seating, first)
    for index in range(5):
        list(rnd.run(index))
    assert rows[0].finish_reason == "length" and runner.cached(0) == len(prompt) + 5
    store_prefixes(seating)
    assert runner.stored == [tuple(rows[0].tokens[: len(prompt) + 5])]
    runner.counts[0] += 1  # a count one token past what the cache holds
    with pytest.raises(ValueError, match="do not hold"):
        store_prefixes(seating)
