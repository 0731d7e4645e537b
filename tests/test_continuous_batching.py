"""Continuous batching: requests join a running batch at a round boundary and leave when
done (Engine.serve, engine/batch.py), exactly: at T = 0 a request that joins mid-answer gets
the tokens it gets alone, and the running rows' tokens do not change, in AR, SD (n-gram,
suffix, a draft model) and SSD. Rows with different params share a batch; a cancelled row
leaves while the others go on; a re-seat re-reads only the uncached tail of a carried row;
and through the server a short request's answer no longer waits for a long one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.batch_serve import greedy, serve
from support.drafts import draft_of

from ssdlocal.backends.prefix import BLOCK_TOKENS
from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.events import DoneEvent, SeatedEvent, TokensEvent
from ssdlocal.core.verify import verify_groups, verify_logits
from ssdlocal.engine import Engine
from ssdlocal.engine.request import Inbox, RowSampling
from ssdlocal.core.sequence import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def foo(x):", "the cat sat on the mat, the cat"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(tiny_dir["draft_llama"]))),
        pin_cpus=False,
    )
    with Engine(config) as eng:
        yield eng


SPECS = {
    "ar": lambda d: SpecConfig(mode=Mode.AR),
    "sd-ngram": lambda d: SpecConfig(mode=Mode.SD, k=3, draft=draft_of("ngram")),
    "sd-suffix": lambda d: SpecConfig(mode=Mode.SD, k=3, draft=draft_of("suffix")),
    "sd-model": lambda d: SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(d["draft_llama"]))),
    "ssd": lambda d: SpecConfig(mode=Mode.SSD, k=2, draft=draft_of(str(d["draft_llama"])), backup="jit"),
}


def ids_of(engine, prompt: str) -> tuple[int, ...]:
    return tuple(engine.encode(prompt, chat=False))


def alone(engine, request: Request, spec: SpecConfig):
    """What `request` gets from a generate call of its own."""
    grammars = [request.grammar] if request.grammar is not None else None
    done = [e for e in engine.generate([list(request.prompt)], request.params, spec=spec, grammars=grammars)][-1]
    assert isinstance(done, DoneEvent)
    return done.outputs[0]


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("case", list(SPECS))
def test_a_request_that_joins_mid_answer_gets_its_alone_tokens(engine, tiny_dir, case):
    spec = SPECS[case](tiny_dir)
    long = Request(ids_of(engine, PROMPTS[0]), greedy(40))
    short = Request(ids_of(engine, PROMPTS[1]), greedy(10))
    later = Request(ids_of(engine, PROMPTS[2]), greedy(12))
    served = serve(engine, spec, [long], joins=[(short, long, 6), (later, long, 20)])
    for request in (long, short, later):
        expected = alone(engine, request, spec)
        assert tuple(served.tokens[request.id]) == expected.token_ids, (case, request.id)
        assert served.finish[request.id] == "length"
    # the short request really joined a batch in which the long one was running
    joined = [s for s in served.seatings if short.id in s.joined]
    assert joined and long.id in joined[0].requests and long.id not in joined[0].joined
    assert served.order.index(short.id) < served.order.index(long.id)  # and it ended first


def test_rows_with_different_params_share_a_batch_and_a_cancelled_row_leaves(engine, tiny_dir):
    pytest.importorskip("llguidance")
    from ssdlocal.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
    words = compiler.regex(r"[a-f]+( [a-f]+)*|[g-z]+( [g-z]+)*")
    spec = SPECS["sd-ngram"](tiny_dir)
    plain = Request(ids_of(engine, PROMPTS[0]), greedy(30))
    sampled = Request(
        ids_of(engine, PROMPTS[1]),
        SamplingParams(temperature=0.8, top_k=20, max_new_tokens=30, ignore_eos=True, seed=3),
    )
    short = Request(ids_of(engine, PROMPTS[2]), greedy(5))
    with_logprobs = Request(ids_of(engine, PROMPTS[3]), greedy(12, logprobs=2))
    constrained = Request(ids_of(engine, "fed a bad"), SamplingParams(max_new_tokens=16), words)
    cancelled = Request(ids_of(engine, PROMPTS[1]), greedy(60))
    served = serve(
        engine,
        spec,
        [plain, sampled, short, with_logprobs, cancelled],
        joins=[(constrained, plain, 4)],
        cancels=[(cancelled, 8)],
    )
    for request in (plain, short, with_logprobs, constrained):
        expected = alone(engine, request, spec)
        assert tuple(served.tokens[request.id]) == expected.token_ids, request.id
    assert len(served.tokens[sampled.id]) == 30 and served.finish[sampled.id] == "length"
    # log-probabilities: only the row that asked, with its own number of alternatives
    lps = served.logprobs[with_logprobs.id]
    assert [lp.token for lp in lps] == served.tokens[with_logprobs.id]
    assert all(len(lp.top) == 2 for lp in lps)
    ref = [
        e
        for e in engine.generate([list(with_logprobs.prompt)], with_logprobs.params, spec=spec)
        if isinstance(e, TokensEvent)
    ]
    expected = [lp for e in ref for lp in e.logprobs]
    assert [round(a.logprob, 3) for a in lps] == [round(b.logprob, 3) for b in expected]
    assert not served.logprobs[plain.id]
    # the cancelled row took no tokens after its next boundary, and left at a re-seat
    assert len(served.tokens[cancelled.id]) < 60
    last = served.seatings[-1]
    assert cancelled.id not in last.requests
    # rows with different settings were verified side by side
    shared = [s for s in served.seatings if {plain.id, sampled.id, constrained.id} <= set(s.requests)]
    assert shared


def test_a_reseat_reads_only_the_uncached_tail_of_a_carried_row(engine, tiny_dir, monkeypatch):
    spec = SPECS["ar"](tiny_dir)
    long = Request(ids_of(engine, PROMPTS[3]), greedy(45))
    short = Request(ids_of(engine, PROMPTS[2]), greedy(6))
    fed: list[list[int]] = []
    feed = engine.runner.feed

    def counting(rows, logits="all", progress=None):
        fed.append([len(r) for r in rows])
        return feed(rows, logits, progress)

    monkeypatch.setattr(engine.runner, "feed", counting)
    served = serve(engine, spec, [long], joins=[(short, long, 30)])
    monkeypatch.undo()
    assert tuple(served.tokens[long.id]) == alone(engine, long, spec).token_ids
    second = next(i for i, s in enumerate(served.seatings) if short.id in s.joined)
    assert served.seatings[second].requests[0] == long.id  # carried first
    carried_read = fed[second][0]
    held = len(long.prompt) + 30 - 1  # at least: its tokens but the pending newest
    assert 1 <= carried_read <= BLOCK_TOKENS, (carried_read, held)  # the rest came from the prefix cache
    assert fed[second][1] == len(short.prompt)  # the new row reads its whole prompt (nothing cached)
    prefill = served.prefills[second]
    assert prefill.prompt_tokens[0] == 0 and prefill.prompt_tokens[1] == len(short.prompt)


LONG_PROMPT = " ".join(PROMPTS * 6)  # a prompt of many chunks


@pytest.mark.parametrize("case", ["ar", "sd-model", "ssd"])
def test_a_long_joining_prompt_is_read_ahead_between_rounds_while_the_running_row_streams(
    engine, tiny_dir, monkeypatch, case
):
    """The joiner's prompt goes into the prefix store a chunk per round boundary (rounds of
    the running row in between), it is seated when the rest fits one chunk, and every
    request still gets its alone tokens; the tokens read ahead are not reported as cache hits."""
    import ssdlocal.engine.ahead as ahead

    monkeypatch.setattr(ahead, "FIRST_CHUNK", 16)
    monkeypatch.setattr(ahead, "MAX_CHUNK", 16)
    spec = SPECS[case](tiny_dir)
    engine.runner.forget_prefixes()
    running = Request(ids_of(engine, PROMPTS[0]), greedy(160))
    joiner = Request(ids_of(engine, LONG_PROMPT), greedy(8))
    assert len(joiner.prompt) > 6 * 16
    log: list[str] = []
    read = engine.runner.read_ahead

    def reading(tokens, n):
        if n:
            log.append("chunk")
        return read(tokens, n)

    monkeypatch.setattr(engine.runner, "read_ahead", reading)
    from ssdlocal.draft.ssd.client import SSDDrafter
    from ssdlocal.draft.sync import ModelDrafter

    for cls in (ModelDrafter, SSDDrafter):  # the draft model reads the same chunks (SSD's worker when idle)
        drafter_read = cls.read_ahead
        monkeypatch.setattr(cls, "read_ahead", lambda self, t, n, f=drafter_read: log.append("draft") or f(self, t, n))
    fed: list[list[int]] = []
    feed = engine.runner.feed
    monkeypatch.setattr(engine.runner, "feed", lambda rows, *a: fed.append([len(r) for r in rows]) or feed(rows, *a))
    served = serve(engine, spec, [running], joins=[(joiner, running, 4)])
    monkeypatch.undo()
    for request in (running, joiner):
        assert tuple(served.tokens[request.id]) == alone(engine, request, spec).token_ids, (case, request.id)
    chunks = log.count("chunk")
    assert chunks >= (len(joiner.prompt) - 1) // 16 - 1  # read a chunk at a time
    assert (log.count("draft") >= chunks - 1) is (case != "ar")
    seat = next(i for i, s in enumerate(served.seatings) if joiner.id in s.joined)
    assert running.id in served.seatings[seat].requests  # it joined the running row
    assert served.prefills[seat].cached_tokens[1] == 0  # nothing of it was cached before
    assert [f[1] for f in fed if len(f) == 2][0] <= 16  # its seat read at most one chunk


def test_a_request_cancelled_while_its_prompt_is_read_ahead_never_joins(engine, tiny_dir, monkeypatch):
    import ssdlocal.engine.ahead as ahead

    monkeypatch.setattr(ahead, "FIRST_CHUNK", 16)
    monkeypatch.setattr(ahead, "MAX_CHUNK", 16)
    spec = SPECS["ar"](tiny_dir)
    engine.runner.forget_prefixes()
    running = Request(ids_of(engine, PROMPTS[1]), greedy(80))
    joiner = Request(ids_of(engine, LONG_PROMPT), greedy(8))
    chunks = []
    read = engine.runner.read_ahead
    monkeypatch.setattr(engine.runner, "read_ahead", lambda t, n: (chunks.append(n) if n else None) or read(t, n))
    inbox, seated, tokens, added = Inbox(), [], [], False
    inbox.add(running)
    for event in engine.serve(inbox, max_batch=8, spec=spec):
        if isinstance(event, SeatedEvent):
            seated.append(event.requests)
        elif isinstance(event, TokensEvent):
            tokens += event.token_ids
            if len(tokens) >= 4 and not added:
                inbox.add(joiner)
                added = True
            if len(chunks) == 2:
                inbox.cancel(joiner.id)  # mid-read
            if event.finish_reason:
                inbox.close()
    assert len(chunks) >= 2 and all(joiner.id not in s for s in seated)
    assert tuple(tokens) == alone(engine, running, spec).token_ids


def joined_after_reading_whole(engine, spec, running_tokens: int):
    """A long prompt joins a running row: both get their alone tokens, and the joiner's
    whole prompt is read at its seat. (served, running, joiner)."""
    running = Request(ids_of(engine, PROMPTS[0]), greedy(running_tokens))
    joiner = Request(ids_of(engine, LONG_PROMPT), greedy(6))
    served = serve(engine, spec, [running], joins=[(joiner, running, 4)])
    for request in (running, joiner):
        assert tuple(served.tokens[request.id]) == alone(engine, request, spec).token_ids
    seat = next(i for i, s in enumerate(served.seatings) if joiner.id in s.joined)
    assert served.prefills[seat].prompt_tokens[1] == len(joiner.prompt)
    return served, running, joiner


def test_a_failed_read_ahead_costs_only_the_reading_ahead(engine, tiny_dir, monkeypatch, caplog):
    """Out of memory while reading a waiting prompt ahead: the running row goes on, the
    request is read whole at its seat, every answer is its alone answer."""
    spec = SPECS["sd-model"](tiny_dir)
    engine.runner.forget_prefixes()

    def failing(tokens, n):
        if n:
            raise torch.OutOfMemoryError("no room for the staging row")
        return 0

    monkeypatch.setattr(engine.runner, "read_ahead", failing)
    joined_after_reading_whole(engine, spec, 40)
    assert "read at its seat" in caplog.text


def test_the_ssd_worker_reads_its_chunk_ahead_even_when_the_next_outcome_waits():
    """A worker that read ahead only when idle fell behind the target (it held a third of
    the prompt at the seat): it reads the whole chunk after its pre-speculation."""
    from types import SimpleNamespace

    from ssdlocal.draft.ssd.worker import DraftWorker

    worker = DraftWorker(SimpleNamespace(poll=lambda: True))  # a message always waits
    asked = []
    worker.runner = SimpleNamespace(read_ahead=lambda tokens, n: asked.append((len(tokens), n)) or n)
    worker._read_ahead(tuple(range(100)), 48)
    assert asked == [(100, 48)]


def test_a_prompt_the_store_cannot_take_is_read_whole_at_its_seat(engine, tiny_dir, monkeypatch):
    spec = SPECS["ar"](tiny_dir)
    monkeypatch.setattr(engine.runner, "read_ahead", lambda tokens, n: 0)  # as with no prefix store
    served, running, joiner = joined_after_reading_whole(engine, spec, 30)
    assert served.tokens[running.id] and served.finish[joiner.id] == "length"


def test_finished_rows_leave_and_max_batch_holds(engine, tiny_dir):
    spec = SPECS["sd-ngram"](tiny_dir)
    rows = [Request(ids_of(engine, p), greedy(n)) for p, n in zip(PROMPTS, (4, 30, 6, 30))]
    late = Request(ids_of(engine, PROMPTS[0]), greedy(8))
    served = serve(engine, spec, rows, joins=[(late, rows[1], 2)], max_batch=3)
    assert all(len(s.requests) <= 3 for s in served.seatings)
    for request in [*rows, late]:
        assert tuple(served.tokens[request.id]) == alone(engine, request, spec).token_ids
    # the short rows left: a later seating serves neither
    assert not {rows[0].id, rows[2].id} & set(served.seatings[-1].requests)


# ----------------------------------------------------------------------------- units
def test_an_exclusive_request_waits_for_an_empty_batch_and_nobody_joins_it():
    inbox = Inbox()
    common = Request((1, 2), greedy(4))
    seeded = Request((1, 2), SamplingParams(temperature=1.0, seed=7), exclusive=("seeded", 1), random_key=1)
    behind = Request((3,), greedy(4))
    inbox.add(seeded, behind)
    assert inbox.take(8, [common]) == []  # the seeded one may not share: it holds the line
    assert inbox.take(8, []) == [seeded]
    assert inbox.take(8, [seeded]) == []  # nobody joins it
    assert inbox.take(8, []) == [behind]


def test_verify_groups_equals_each_group_on_its_own():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 11)
    drafts = torch.randint(0, 11, (5, 2))
    n_draft = torch.tensor([2, 1, 2, 0, 2])
    hot = SamplingParams(temperature=0.9, top_k=5)
    requests = [Request((1,), p) for p in (greedy(4), hot, greedy(4), hot, hot)]
    sampling = RowSampling(requests, "cpu", {})
    got = sampling.verify(logits, drafts, None, n_draft)
    rows_hot, rows_greedy = [1, 3, 4], [0, 2]
    ref_hot = verify_logits(
        logits[rows_hot], drafts[rows_hot], None, hot, torch.Generator().manual_seed(hot.seed), n_draft[rows_hot]
    )
    ref_greedy = verify_logits(logits[rows_greedy], drafts[rows_greedy], None, greedy(4), None, n_draft[rows_greedy])
    assert got.n_accepted[rows_hot].tolist() == ref_hot.n_accepted.tolist()
    assert got.bonus[rows_hot].tolist() == ref_hot.bonus.tolist()
    assert got.bonus[rows_greedy].tolist() == ref_greedy.bonus.tolist()
    one = verify_groups(logits, drafts, None, [(None, greedy(4), None)], n_draft)
    assert one.bonus.tolist() == verify_logits(logits, drafts, None, greedy(4), None, n_draft).bonus.tolist()


def test_a_draft_model_draws_each_row_from_its_own_warp():
    """Rows of three sampling settings in one draft step: each row's q is its own warp of
    the draft's logits (a greedy row's one-hot), and its draft follows that q."""
    from types import SimpleNamespace

    from support.stats import assert_distribution

    from ssdlocal.core.sampling import logits_to_probs
    from ssdlocal.draft.decode import DraftDecoder, Drafting

    settings = [greedy(4), SamplingParams(temperature=0.7), SamplingParams(temperature=1.5, top_k=3)]
    per = 1500
    row_params = [p for p in settings for _ in range(per)]
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, 0.2, -0.5])
    drafting = Drafting(SimpleNamespace(device=torch.device("cpu")), 1, settings[1], 8, row_params)
    decoder = DraftDecoder(drafting, torch.Generator().manual_seed(3))
    drafted = decoder.decode(logits.expand(len(row_params), 8).clone(), bound=0)
    for i, params in enumerate(settings):
        rows = slice(i * per, (i + 1) * per)
        want = logits_to_probs(logits, params)
        assert torch.allclose(drafted.q[rows, 0], want.expand(per, 8))
        if params.greedy:
            assert (drafted.tokens[rows, 0] == logits.argmax()).all()
        else:
            assert_distribution(drafted.tokens[rows, 0], want, what=f"row setting {i}")


# ----------------------------------------------------------------------------- server
def test_a_short_request_is_answered_while_a_long_stream_runs(tiny_dir, monkeypatch):
    from support.server import MODEL, LiveServer

    live = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32"), pin_cpus=False))
    try:
        step = live.engine.runner.step

        def slow(*args, **kwargs):  # the long answer surely still streams when the short one comes
            time.sleep(0.01)
            return step(*args, **kwargs)

        monkeypatch.setattr(live.engine.runner, "step", slow)
        alone = live.client.completions.create(
            model=MODEL,
            prompt="Hi there",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        stream = live.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)  # the long answer is under way
        events: list[tuple[str, float]] = []
        with ThreadPoolExecutor(1) as pool:
            short = pool.submit(
                live.client.completions.create,
                model=MODEL,
                prompt="Hi there",
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            short.add_done_callback(lambda _: events.append(("short answered", time.perf_counter())))
            for _ in chunks:
                events.append(("long chunk", time.perf_counter()))
            reply = short.result(timeout=60)
        order = [name for name, _ in sorted(events, key=lambda e: e[1])]
        assert "short answered" in order and order.index("short answered") < len(order) - 1  # long chunks after it
        assert reply.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
        assert reply.model_extra["ssdlocal"]["batch_size"] == 2  # it joined the running batch
        assert reply.model_extra["ssdlocal"]["queue_s"] is not None
        status, text = live.get("/metrics")
        assert status == 200 and "ssdlocal_queue_time_seconds_count" in text and "ssdlocal_rows_running" in text
    finally:
        live.close()


@pytest.mark.draft_loss
def test_six_streams_finish_when_the_ssd_worker_dies_mid_answer(engine, tiny_dir):
    """A dead draft worker costs speed, not answers: the rows in flight go on with plain
    steps and give their alone tokens, the seating's stats say the draft was lost, and the
    next seating (a request that joins) starts a new worker."""
    import os
    import signal

    from ssdlocal.core.events import DraftLostEvent, SeatingDoneEvent
    from ssdlocal.server.metrics import ServerMetrics

    served = ServerMetrics("tiny", "ssd", "test")  # what the server's /metrics would say
    spec = SPECS["ssd"](tiny_dir)
    requests = [Request(ids_of(engine, PROMPTS[i % len(PROMPTS)]), greedy(18 + 3 * i)) for i in range(6)]
    inbox, tokens, lost, losses, killed = Inbox(), defaultdict(list), [], [], []
    inbox.add(*requests[:4])
    seated: list[int] = []
    late_added = False
    for event in engine.serve(inbox, max_batch=8, spec=spec):
        if isinstance(event, SeatedEvent):
            seated = list(event.requests)
        elif isinstance(event, TokensEvent):
            tokens[seated[event.row]] += event.token_ids
            if not killed and sum(map(len, tokens.values())) > 20:
                killed.append(engine.drafts.worker.proc.pid)
                os.kill(killed[0], signal.SIGKILL)
            if killed and lost and not late_added:
                inbox.add(*requests[4:])  # they join at the next seating: a new worker
                late_added = True
        elif isinstance(event, DraftLostEvent):
            lost.append(event)
        elif isinstance(event, SeatingDoneEvent):
            losses.append(event.stats.draft_losses)
            served.record_batch(event.stats, 0.1)
        if late_added and all(len(tokens[r.id]) == r.params.max_new_tokens for r in requests):
            inbox.close()
    assert len(lost) == 1 and "died" in lost[0].reason and sum(losses) == 1
    assert "\nssdlocal_draft_losses_total 1\n" in served.render(0, 0)
    for request in requests:
        assert tuple(tokens[request.id]) == alone(engine, request, SPECS["ar"](tiny_dir)).token_ids
    assert engine.drafts.worker.proc.pid != killed[0] and engine.drafts.worker.proc.is_alive()
