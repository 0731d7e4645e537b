"""The prefix cache of a hybrid model (Qwen3.5: linear-attention layers beside attention,
backends/torch/stored_states.py): a stored prefix brings back the linear layers' state at
its end as well as its KV blocks, so a hit gives the logits and tokens of a cold read.

At the runner: every reuse of a stored prefix, full or partial, ends at a block whose
state was kept for that very block (a prompt diverging inside a stored sequence, one
ending inside a block, blocks evicted and handed to other tokens), and the logits after it
equal a cold read's. In the engine: the call sequence of test_prefix_cache.py (a chat's
turns, two conversations, strict prefixes, a batch) in AR, SD with a hybrid draft model,
SSD, and in traced graphs, each call equal to a fresh engine without the cache; and
continuous batching with a hybrid target (rows joining a running batch and leaving).
"""

from __future__ import annotations

import pytest
import torch
from support.drafts import draft_of
from support.tiny_families import make_qwen3_5
from support.tiny_models import build_tokenizer, make_draft_like
from support.prefix_calls import SYSTEM, prompt_ids, run_sequence

from ssdlocal.backends.base import Logits
from ssdlocal.backends.prefix import BLOCK_TOKENS
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
B = BLOCK_TOKENS


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5 target and a noisy copy of it as its draft."""
    root = tmp_path_factory.mktemp("hybrid_prefix")
    build_tokenizer(root / "tokenizer")
    target = make_qwen3_5(root / "qwen3_5", root / "tokenizer", max_position_embeddings=1024)
    return str(target), str(make_draft_like(target, root / "draft", noise=0.004, seed=31))


def _runner(path: str, prefix_tokens: int | None):
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.hybrid_runner import HybridRunner

    runner = HybridRunner(registry.load(ModelSpec(path, dtype="float32")), graphs="off")
    runner.setup_prefix(prefix_tokens)
    return runner


def _cold(runner, tokens: list[int]) -> torch.Tensor:
    """The last logits of `tokens` read from nothing (the store untouched)."""
    runner.reset(1, 512)
    return runner.feed([tokens], Logits.LAST)[0][-1]


def _hit(runner, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Reuse what the store holds of `tokens`, read the rest: (tokens reused, last logits)."""
    runner.reset(1, 512)
    n = runner.reuse(0, tokens)
    assert n < len(tokens)
    return n, runner.feed([tokens[n:]], Logits.LAST)[0][-1]


def test_a_hit_ends_only_at_a_block_whose_state_was_kept_and_equals_a_cold_read(hybrid):
    target, _ = hybrid
    runner = _runner(target, 6 * B)  # six blocks: the later stores evict the earlier ones
    a = prompt_ids(11, 3 * B + 5)
    runner.reset(1, 512)
    runner.feed([a], Logits.NONE)
    runner.store(0, a)  # blocks 0-2 of a, the state after block 2 (position 47)
    report = runner.prefix_report()
    assert report["state_slots"] > 0 and report["state_bytes"] > 0
    cases = {
        "a's next turn": a + prompt_ids(12, 9),
        "strict prefix ending inside a block": a[: 3 * B + 2],
        "diverges inside block 2": a[: 2 * B + 3] + prompt_ids(13, 20),  # blocks 0-1 stored, no state at 31
        "diverges at block 1's end": a[:B] + prompt_ids(14, 20),
        "diverges at its first token": [299] + a[1:],
    }
    want_reused = {
        "a's next turn": 3 * B,
        "strict prefix ending inside a block": 3 * B,
        "diverges inside block 2": 0,
        "diverges at block 1's end": 0,
        "diverges at its first token": 0,
    }
    for name, tokens in cases.items():
        n, got = _hit(runner, tokens)
        assert n == want_reused[name], name
        torch.testing.assert_close(got, _cold(runner, tokens), rtol=1e-5, atol=1e-5, msg=name)
    # a shorter sequence stored too: its own block end carries a state of its own
    short = a[: 2 * B + 3]
    runner.reset(1, 512)
    runner.feed([short], Logits.NONE)
    runner.store(0, short)
    n, got = _hit(runner, short + prompt_ids(15, 7))
    assert n == 2 * B
    torch.testing.assert_close(got, _cold(runner, short + prompt_ids(15, 7)), rtol=1e-5, atol=1e-5)
    # other sequences take the pool blocks: a block number handed to other tokens never
    # brings back the state its earlier tokens left
    for seed in (16, 17, 18):
        other = prompt_ids(seed, 3 * B + 1)
        runner.reset(1, 512)
        runner.feed([other], Logits.NONE)
        runner.store(0, other)
    assert runner.prefix_report()["evicted_tokens"] > 0
    for tokens in (
        a + prompt_ids(12, 9),
        short + prompt_ids(15, 7),
        prompt_ids(18, 3 * B + 1) + [7, 8],
        prompt_ids(16, 2 * B + 4),
    ):
        n, got = _hit(runner, tokens)
        assert n % B == 0
        torch.testing.assert_close(got, _cold(runner, tokens), rtol=1e-5, atol=1e-5)


def test_the_state_stored_comes_from_steps_as_well_as_feeds(hybrid):
    """A row whose block end was written by decode steps (not by a feed) stores its state
    there: the next turn reuses it and reads exactly as cold."""
    target, _ = hybrid
    runner = _runner(target, None)
    prompt = prompt_ids(21, B + 10)
    runner.reset(1, 512)
    runner.feed([prompt], Logits.NONE)
    runner.begin_steps()
    tokens = list(prompt)
    token = 5
    for _ in range(12):  # past the block end at position 2B - 1
        runner.step(torch.tensor([[token]]))
        runner.advance(1, [1])
        tokens.append(token)
        token = (token * 7 + 3) % 300 + 5
    runner.end_steps({0: tokens[len(prompt) :]})
    runner.store(0, tokens)
    turn = tokens + prompt_ids(22, 5)
    n, got = _hit(runner, turn)
    assert n == 2 * B
    torch.testing.assert_close(got, _cold(runner, turn), rtol=1e-5, atol=1e-5)


CASES = {
    "ar": lambda draft: SpecConfig(mode=Mode.AR),
    "sd": lambda draft: SpecConfig(mode=Mode.SD, k=3, draft=draft_of(draft), backup="jit"),
    "sd-ngram": lambda draft: SpecConfig(mode=Mode.SD, k=3, draft=draft_of("ngram")),
    "ssd": lambda draft: SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(draft), backup="jit"),
}


@pytest.fixture(scope="module")
def reference(hybrid):
    config = EngineConfig(target=ModelSpec(hybrid[0], dtype="float32"), prefix_cache_tokens=0, graphs="off")
    with Engine(config) as engine:
        yield engine


@pytest.mark.parametrize(("case", "graphs"), [("ar", "off"), ("sd", "trace"), ("sd-ngram", "off"), ("ssd", "off")])
def test_every_call_equals_a_fresh_engine_without_the_cache(hybrid, reference, case, graphs):
    target, draft = hybrid
    spec = CASES[case](draft)
    with Engine(EngineConfig(target=ModelSpec(target, dtype="float32"), spec=spec, pin_cpus=False, graphs=graphs)) as e:
        cached = run_sequence(e, reference)
        report = e.prefix_reports()["target"]
        replays = e.runner.graphs.stats.as_dict()["replays"] if graphs == "trace" else None
    first_turn, next_turn, other, back, prefix, diverged, batch = cached
    assert first_turn == 0 and diverged == 0
    assert next_turn >= len(SYSTEM) + 20 + 10 - B  # all of the last turn but a partial block
    assert back > next_turn and batch > 0  # `other` shares only the system message: no state kept at its end
    assert report["reused_tokens"] >= sum(cached) and report["state_slots"] > 0
    assert replays is None or replays > 0


def _tokens(engine: Engine, prompts, spec, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
    return [list(o.token_ids) for o in done.outputs]


def test_rows_joining_and_leaving_a_running_hybrid_batch_get_their_alone_tokens(hybrid):
    """In traced graphs, AR (test_families covers AR and SSD eagerly; 62 s for SD here)."""
    case = "ar"
    from support.batch_serve import greedy, serve

    from ssdlocal.core.sequence import Request

    target, draft = hybrid
    spec = CASES[case](draft)
    config = EngineConfig(target=ModelSpec(target, dtype="float32"), spec=spec, pin_cpus=False, graphs="trace")
    with Engine(config) as engine:
        long = Request(tuple(SYSTEM[:40]), greedy(40))
        short = Request(tuple(prompt_ids(31, 9)), greedy(8))
        later = Request(tuple(SYSTEM[:20] + prompt_ids(32, 30)), greedy(12))
        served = serve(engine, spec, [long], joins=[(short, long, 6), (later, long, 18)])
        for request in (long, short, later):
            assert (
                served.tokens[request.id]
                == _tokens(engine, [list(request.prompt)], spec, request.params.max_new_tokens)[0]
            )
            assert served.finish[request.id] == "length"
        joined = [s for s in served.seatings if short.id in s.joined]
        assert joined and long.id in joined[0].requests and long.id not in joined[0].joined
        assert served.order.index(short.id) < served.order.index(long.id)
