"""Captured steps with CUDA-graph semantics on the CPU (SSDLOCAL_GRAPHS=trace): a replay runs
the traced op graph over the tensors held at capture, never the Python step, so anything
that a GPU would read stale is read stale here too.

The cases are the ones a stale read breaks: many generate calls on one engine (the same
batch size again, other sizes, other lengths), chat turns, SD after SSD on one target, a
feed longer than 64 tokens, KV-cache growth in the middle of an answer, five sequential
and four concurrent server requests. Each equals the eager engine token for token, with
replays actually serving steps. The last tests show that the runner's old habit (per-row
lengths rebound on every call) is caught by the guard, and gives wrong tokens when it
is not guarded.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from ssdlocal.backends.torch import runner as runner_mod
from ssdlocal.backends.torch.graphs import GraphSafetyError
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from ssdlocal.core.config import ModelDraft

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

K = 3
LONG = " ".join(f"word{i}" for i in range(60))  # > 64 tokens: the feed is wider than 64
CALLS = [  # (prompts, max_new_tokens): lengths and batch sizes change from call to call
    (["hello world, def foo(x):"], 12),
    (["the cat sat"], 12),  # the same batch size again: what a stale read breaks first
    (["Once upon a time", "a", "def bar(y): return"], 9),
    ([LONG], 10),
    (["the cat sat", "hello"], 14),
    (["x = 1"], 16),
]


def _config(tiny_dir, target: str, draft: str, graphs: str, mode: Mode = Mode.SSD) -> EngineConfig:
    t, d = str(tiny_dir[target]), str(tiny_dir[draft])
    return EngineConfig(
        target=ModelSpec(t, dtype="float32"),
        spec=SpecConfig(mode=mode, k=K, draft=ModelDraft(ModelSpec(d, dtype="float32")), backup="jit"),
        pin_cpus=False,
        graphs=graphs,
    )


def _run(engine: Engine, prompts, max_new: int, mode: Mode, **spec):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    call_spec = SpecConfig(mode=mode, k=K, draft=engine.config.spec.draft, backup="jit", **spec)
    done = [e for e in engine.generate(prompts, params, spec=call_spec) if isinstance(e, DoneEvent)][0]
    return [o.token_ids for o in done.outputs], done.stats


@pytest.fixture(scope="module")
def engines(tiny_dir):
    made = {g: Engine(_config(tiny_dir, "qwen2", "draft_qwen2", g)) for g in ("off", "trace")}
    yield made
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("mode", [Mode.AR, Mode.SD, Mode.SSD])
def test_many_calls_on_one_engine_equal_eager(engines, mode):
    """Every call of a sequence (batch sizes 1, 1, 3, 1 with a 60-word prompt, 2, 1) on one
    traced engine equals the eager engine's call, and replays serve the steps."""
    replays = 0
    for prompts, max_new in CALLS:
        want, _ = _run(engines["off"], prompts, max_new, mode)
        got, stats = _run(engines["trace"], prompts, max_new, mode)
        assert got == want, (mode, prompts)
        assert stats["graphs"]["target"]["mode"] == "trace"
        assert stats["graphs"]["target"]["dropped"] == 0
        replays += stats["graphs"]["target"]["replays"]
        if mode is not Mode.AR:  # the draft model's steps are captured too (SD here, SSD in its worker)
            assert stats["graphs"]["draft"]["mode"] == "trace"
    assert replays > 0


def test_sd_after_ssd_and_ssd_after_sd_on_one_target(engines):
    sequence = [Mode.SSD, Mode.SD, Mode.AR, Mode.SSD, Mode.SD]
    prompts = ["hello world, def foo(x):", "the cat"]
    want = [_run(engines["off"], prompts, 14, m)[0] for m in sequence]
    got = [_run(engines["trace"], prompts, 14, m)[0] for m in sequence]
    assert got == want
    assert all(g == want[2] for g in got)  # and all equal AR (greedy exactness)


def test_three_chat_turns_equal_eager(engines):
    from ssdlocal.tui.core import Conversation

    answers: dict[str, list[str]] = {}
    for graphs, engine in engines.items():
        chat, said = Conversation(), []
        for user in ("hi", "write a function", "and a test for it"):
            ids = chat.prompt_ids(engine.tokenizer, user)
            tokens, _ = _run(engine, [ids], 10, Mode.SD)
            answer = engine.tokenizer.decode(tokens[0])
            chat.add_turn(user, answer)
            said.append(answer)
        answers[graphs] = said
    assert answers["trace"] == answers["off"]


def test_kv_cache_growth_in_the_middle_of_an_answer(tiny_dir, monkeypatch):
    """The cache starts at 256 slots and doubles while a row decodes past it: graphs are
    recaptured on the grown cache (and the RoPE tables cover the new slots)."""
    monkeypatch.setattr(runner_mod, "FIRST_CAPACITY", 256)
    prompt = [5 + (i * 7) % 300 for i in range(230)]
    out = {}
    for graphs in ("off", "trace"):
        with Engine(_config(tiny_dir, "llama", "draft_llama", graphs, Mode.SD)) as engine:
            tokens, stats = _run(engine, [prompt], 60, Mode.SD)
            assert engine.runner.capacity == 512
            out[graphs] = tokens
    assert out["trace"] == out["off"]
    assert stats["graphs"]["target"]["captured"] >= 2 and stats["graphs"]["target"]["replays"] > 0


def test_five_sequential_and_four_concurrent_server_requests(tiny_dir, monkeypatch):
    from support.server import LiveServer

    def ask(server, prompt):
        done = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        return done.choices[0].text, done.model_extra["ssdlocal"]

    prompts = ["hello world", "the cat sat on", "def foo(x):", "Once upon a time", "x = 1 +"]
    results = {}
    for graphs in ("off", "trace"):
        monkeypatch.setenv("SSDLOCAL_GRAPHS", graphs)
        server = LiveServer(_config(tiny_dir, "llama", "draft_llama", "auto", Mode.SD))
        try:
            sequential = [ask(server, p) for p in prompts]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                concurrent_ = list(pool.map(lambda p: ask(server, p), prompts[:4]))
        finally:
            server.close()
        results[graphs] = ([t for t, _ in sequential], [t for t, _ in concurrent_])
        if graphs == "trace":
            assert sum(s["graphs"]["target"]["replays"] for _, s in sequential) > 0
    assert results["trace"] == results["off"]
    assert results["trace"][1] == results["trace"][0][:4]


# --------------------------------------------------------------------------- the old habit
def _rebinding_begin_steps(self) -> None:
    """The runner before this fix: a new lengths tensor on every call."""
    object.__setattr__(self.state, "lengths", torch.tensor([len(h) for h in self.held]))


def test_a_rebound_lengths_tensor_is_caught_by_the_guard(tiny_dir, monkeypatch):
    monkeypatch.setattr(runner_mod.TorchRunner, "begin_steps", _rebinding_begin_steps)
    with Engine(_config(tiny_dir, "qwen2", "draft_qwen2", "trace", Mode.AR)) as engine:
        _run(engine, ["hello world"], 8, Mode.AR)  # the first call captures
        with pytest.raises(GraphSafetyError, match="runner.state.lengths"):
            _run(engine, ["the cat"], 8, Mode.AR)  # the second rebinds, then replays


def test_unguarded_the_rebound_lengths_give_wrong_tokens(tiny_dir, monkeypatch):
    """What a GPU would have done: with the guard and the self-check off, the traced
    replays of the second call read the first call's lengths and emit other tokens."""
    from ssdlocal.backends.torch import graphs as graphs_mod

    prompts = [["hello world, def foo(x):"], ["the cat sat on the mat and"], ["x"]]
    with Engine(_config(tiny_dir, "qwen2", "draft_qwen2", "off", Mode.AR)) as eager:
        want = [_run(eager, p, 12, Mode.AR)[0] for p in prompts]
    monkeypatch.setattr(runner_mod.TorchRunner, "begin_steps", _rebinding_begin_steps)
    unguarded = graphs_mod.make_graph_cache

    def no_guards(device, mode, statics=None):
        cache = unguarded(device, mode, None)
        if cache is not None:
            cache.self_check = False
        return cache

    monkeypatch.setattr(runner_mod, "make_graph_cache", no_guards)
    with Engine(_config(tiny_dir, "qwen2", "draft_qwen2", "trace", Mode.AR)) as traced:
        got = [_run(traced, p, 12, Mode.AR)[0] for p in prompts]
    assert got[0] == want[0]  # the first call captured with its own lengths
    assert got[1:] != want[1:]  # later calls replay stale positions: wrong tokens, no error


# --------------------------------------------------------------------------- serving
WAVE = ["The quick brown fox", "hello world, def foo(x):", "Once upon a time there was", "x = 1"]


def _wave(engine, spec, first_id: int) -> dict[int, list[int]]:
    """Four requests served, each joining once the one before it has 3 tokens."""
    from ssdlocal.core.events import SeatedEvent, TokensEvent
    from ssdlocal.engine.request import Inbox, Request

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    requests = [Request(tuple(engine.encode(p, chat=False)), params, id=first_id + i) for i, p in enumerate(WAVE)]
    inbox, waiting = Inbox(), list(requests[1:])
    inbox.add(requests[0])
    tokens: dict[int, list[int]] = {r.id: [] for r in requests}
    finished, seated = set(), []
    for event in engine.serve(inbox, max_batch=4, spec=spec):
        if isinstance(event, SeatedEvent):
            seated = list(event.requests)
        elif isinstance(event, TokensEvent):
            tokens[seated[event.row]] += event.token_ids
            if event.finish_reason is not None:
                finished.add(seated[event.row])
        if waiting and len(tokens[requests[len(requests) - len(waiting) - 1].id]) >= 3:
            inbox.add(waiting.pop(0))
        if not waiting and finished >= set(tokens):
            inbox.close()
    return {rid - first_id: t for rid, t in tokens.items()}


def test_served_waves_capture_nothing_after_the_start(tiny_dir, monkeypatch):
    """Joins and leaves change the batch size at every re-seat; the caches keep their rows
    and graphs, and the server captured its steps at start: two waves of the same staggered
    requests capture nothing (before: each wave captured 7-8 target and 17-19 draft graphs),
    with the eager server's tokens."""
    waves = {}
    for graphs in ("off", "trace"):
        monkeypatch.setenv("SSDLOCAL_GRAPHS", graphs)
        engine = Engine(_config(tiny_dir, "llama", "draft_llama", "auto", Mode.SD))
        with engine:
            spec = SpecConfig(mode=Mode.SD, k=K, draft=engine.config.spec.draft)
            out, counts = [], []
            for w in range(2):
                before = [r.graph_report() for r in (engine.runner, engine.parts.drafts.runner)]
                out.append(_wave(engine, spec, 100 * (w + 1)))
                counts.append([r.graph_report(b) for r, b in zip((engine.runner, engine.parts.drafts.runner), before)])
        waves[graphs] = out
    assert waves["trace"] == waves["off"]
    first, second = counts
    assert first[0]["captured"] > 0 and first[1]["captured"] > 0  # the start's warm-up (inside the first serve)
    assert [c["captured"] for c in second] == [0, 0], second
    assert all(c["replays"] > 0 and c["dropped"] == 0 and c["refused"] == 0 for c in second)
