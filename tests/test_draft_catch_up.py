"""The draft model's catch-up (draft/sync.py ModelDrafter._catch_up) through captured graphs:
a catch-up longer than one chunk replays the same graph again, whose output is a static
buffer, so rows that finished in an earlier chunk must not read the later chunk's logits.
Traced (SSDLOCAL_GRAPHS=trace semantics) and eager runs give the same drafts, and the same
acceptance against the target's greedy continuation; real tiny fp32 checkpoints."""

from __future__ import annotations

import pytest

from ssdlocal.backends import registry
from ssdlocal.backends.base import Logits
from ssdlocal.backends.torch.runner import TorchRunner
from ssdlocal.core.config import ModelSpec, SamplingParams
from ssdlocal.draft.decode import Drafting
from ssdlocal.draft.sync import CATCH_UP, ModelDrafter
from support.drafts import row_views

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

K = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None)


def _sequence(n: int, seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 280 for i in range(n)]


def _drafts(loaded, graphs: str, sequences, cached) -> list[list[int]]:
    """K drafts per row after the draft catches up from `cached` tokens per row."""
    runner = TorchRunner(loaded, graphs=graphs)
    vocab = loaded.args.vocab_size
    drafter = ModelDrafter(Drafting(runner, K, GREEDY, vocab), "cpu")
    rows = row_views(*sequences)
    drafter.start(rows)
    runner.reset(len(rows), max(map(len, sequences)) + K + CATCH_UP + 8)
    runner.feed([seq[:c] for seq, c in zip(sequences, cached)], Logits.NONE)
    runner.begin_steps()
    drafter.cached, drafter._fed = list(cached), list(cached)  # what an earlier round left
    return drafter.propose([True] * len(rows)).drafts.tolist()


def _accepted(drafts: list[int], target: list[int]) -> int:
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


@pytest.mark.parametrize("lacking", [(2 * CATCH_UP + 6, 3), (3, 2 * CATCH_UP), (CATCH_UP + 1, CATCH_UP)])
def test_a_long_catch_up_drafts_the_same_traced_and_eager(tiny_dir, lacking):
    """One row lacks more than a chunk (two chunks of the same width: the same graph twice),
    the other ends in the first chunk: its logits are the first chunk's, traced or not."""
    loaded = registry.load(ModelSpec(str(tiny_dir["draft_llama"]), dtype="float32"))
    cached = [20, 40]
    sequences = [_sequence(c + n, seed) for seed, (c, n) in enumerate(zip(cached, lacking))]
    eager = _drafts(loaded, "off", sequences, cached)
    traced = _drafts(loaded, "trace", sequences, cached)
    assert traced == eager
    target = ModelSpec(str(tiny_dir["llama"]), dtype="float32")
    runner = TorchRunner(registry.load(target), graphs="off")
    runner.reset(2, max(map(len, sequences)) + K + 8)
    greedy = []
    for b, seq in enumerate(sequences):  # the target's greedy continuation of each row
        tokens = list(seq)
        for _ in range(K):
            runner.reset(1, len(tokens) + 8)
            tokens.append(int(runner.feed([tokens], Logits.LAST)[0][-1].argmax()))
        greedy.append(tokens[len(seq) :])
    assert [_accepted(d, g) for d, g in zip(traced, greedy)] == [_accepted(d, g) for d, g in zip(eager, greedy)]
