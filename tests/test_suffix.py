"""Suffix proposals and K per round: the index, the bounded memory and its file, the cost
model and the chooser (pure), then the engine: greedy output equal to AR token for token
with the suffix drafter, the hybrid (draft model + suffix), adaptive K and SSD's suffix
backup, over several calls on one engine (the memory growing), and what the stats say.
"""

from __future__ import annotations

import json
import os

import pytest

from support.drafts import draft_of
from ssdlocal.core.config import (
    EngineConfig,
    MemorySettings,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
    SuffixDraft,
    repeatable,
)
from ssdlocal.core.events import DoneEvent
from ssdlocal.draft.suffix import MemoryFile
from ssdlocal.engine import Engine
from ssdlocal.speculation.adaptive import Acceptance, CostModel, choose, expected_tokens, suffix_key
from ssdlocal.speculation.suffix import SuffixIndex, SuffixMemory, propose

CODE = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
VOCAB = 100  # the memory files of these tests are for a model with token ids 0..99


# --------------------------------------------------------------------------- the index
def test_a_repeat_in_the_row_is_proposed_with_full_confidence():
    row = SuffixIndex([1, 2] + CODE + [3, 4] + CODE[:3])
    found = propose(row.tokens, row, [], 5)
    assert found.tokens == tuple(CODE[3:8]) and found.confidence == (1.0,) * 5 and found.match_len >= 3


def test_disagreeing_history_shortens_the_proposal():
    memory = SuffixMemory()
    for tail in ([50, 60, 70], [50, 61, 71], [50, 62, 72]):  # all agree on 50, then split three ways
        memory.add([1, 2, 3, 4] + tail)
    context = [9, 3, 4]
    sure = propose(context, SuffixIndex(context), memory.indexes(), 3, min_confidence=0.5)
    assert sure.tokens == (50,)  # the next token is unanimous, the one after is not
    bold = propose(context, SuffixIndex(context), memory.indexes(), 3, min_confidence=0.3)
    assert bold.tokens[0] == 50 and bold.confidence[1:] == pytest.approx((1 / 3, 1 / 3))  # one branch, to its end


def test_only_the_last_max_match_tokens_of_the_context_are_read():
    """The SSD worker passes only a row's tail when it seeds branches: same proposal."""
    import random

    from ssdlocal.speculation.suffix import MAX_MATCH

    rng = random.Random(0)
    block = [rng.randrange(4) for _ in range(2 * MAX_MATCH)]  # small vocab: many matches
    seq = [rng.randrange(4) for _ in range(100)] + block + [rng.randrange(4) for _ in range(50)] + block
    memory = SuffixMemory()
    memory.add([rng.randrange(4) for _ in range(300)])
    own = SuffixIndex(seq)
    for end in (MAX_MATCH + 5, 150, len(seq) - 7, len(seq)):
        context = seq[:end]
        full = propose(context, own, memory.indexes(), 6)
        assert full == propose(context[-MAX_MATCH:], own, memory.indexes(), 6)
    assert full.match_len == MAX_MATCH and full.tokens  # the longest match: the repeat


def test_nothing_matches_nothing_is_proposed():
    assert propose([1, 2, 3], SuffixIndex([1, 2, 3]), [], 4).tokens == ()
    assert propose([5], SuffixIndex([5]), [], 4).tokens == ()  # shorter than a key


def test_memory_is_bounded_by_sequences_and_tokens():
    by_count = SuffixMemory(max_sequences=2, max_tokens=1000)
    for i in range(5):
        by_count.add([i] * 3 + CODE)
    assert len(by_count) == 2 and [s[0] for s in by_count.sequences()] == [3, 4]  # the oldest went
    by_tokens = SuffixMemory(max_sequences=100, max_tokens=25)
    for i in range(5):
        by_tokens.add([i] + CODE)
    assert by_tokens.tokens <= 25 and len(by_tokens) == 2
    assert SuffixMemory(max_tokens=0).add(CODE) is None and not SuffixMemory(max_tokens=0).sequences()


def test_the_memory_file_is_per_model_and_damage_is_ignored(tmp_path):
    memory = SuffixMemory()
    memory.add([1, 2, 3] + CODE)
    MemoryFile(tmp_path, "model-a", VOCAB).save(memory)
    again = SuffixMemory()
    MemoryFile(tmp_path, "model-a", VOCAB).load(again)
    assert again.sequences() == memory.sequences()
    other = SuffixMemory()
    MemoryFile(tmp_path, "model-b", VOCAB).load(other)  # another model: another file, nothing
    assert not other.sequences()
    file = MemoryFile(tmp_path, "model-a", VOCAB)
    file.path.write_text("{not json")
    damaged = SuffixMemory()
    file.load(damaged)
    assert not damaged.sequences()
    file.path.write_text(json.dumps({"model": "model-b", "sequences": [[1, 2, 3, 4]]}))
    file.load(damaged)  # a file whose key is another model's is not trusted
    assert not damaged.sequences() and not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize(
    "bad", [[10**9] + CODE, [-7] + CODE, [2**70] + CODE, [True] + CODE, [1.5] + CODE, "nested", "string"]
)
def test_memory_entries_outside_the_vocabulary_are_dropped_with_one_warning(tmp_path, caplog, bad):
    """Ids past the embedding, negative, huge, booleans, or nesting 100k deep: the file's
    good entries load, the bad ones are dropped, one warning names the file."""
    file = MemoryFile(tmp_path, "model-a", VOCAB)
    good = [1, 2, 3] + CODE
    if bad == "nested":
        file.path.write_text('{"model": "model-a", "sequences": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        entry = "oops" if bad == "string" else bad
        file.path.write_text(json.dumps({"model": "model-a", "sequences": [good, entry, entry]}))
    memory = SuffixMemory()
    with caplog.at_level("WARNING"):
        file.load(memory)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(file.path) in warnings[0].getMessage(), caplog.text
    assert memory.sequences() == ([] if bad == "nested" else [good])
    for seq in memory.sequences():
        assert all(0 <= t < VOCAB for t in seq)


def test_a_memory_file_that_is_a_fifo_is_not_opened(tmp_path, caplog):
    file = MemoryFile(tmp_path, "model-a", VOCAB)
    os.mkfifo(file.path)
    memory = SuffixMemory()
    with caplog.at_level("WARNING"):
        file.load(memory)  # would block forever if it opened the FIFO
    assert not memory.sequences() and "FIFO" in caplog.text and str(file.path) in caplog.text


def test_a_failed_save_is_one_warning_and_leaves_no_temporary_file(tmp_path, caplog, monkeypatch):
    import errno

    memory = SuffixMemory()
    memory.add([1, 2, 3] + CODE)
    file = MemoryFile(tmp_path, "model-a", VOCAB)
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        if "w" in mode:
            handle.write = lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return handle

    monkeypatch.setattr("builtins.open", full_disk)
    with caplog.at_level("WARNING"):
        file.save(memory)  # no exception: the call it follows has its answer
        file.save(memory)
    monkeypatch.undo()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1, caplog.text
    assert "No space left" in caplog.text and not list(tmp_path.iterdir())
    file.save(memory)  # the disk has room again
    again = SuffixMemory()
    MemoryFile(tmp_path, "model-a", VOCAB).load(again)
    assert again.sequences() == memory.sequences()


# --------------------------------------------------------------------------- K per round
def _cpu_like() -> CostModel:
    """Block-shaped CPU costs (measured shape of torch's int4 kernel): T=2 free, T=5 jumps."""
    costs = CostModel()
    costs.seed_widths({1: 0.070, 2: 0.070, 3: 0.087, 4: 0.096, 5: 0.151, 8: 0.19, 9: 0.24, 12: 0.27, 13: 0.31})
    costs.draft_token_s = 0.03
    return costs


def test_a_confident_suffix_is_cut_where_the_verify_gets_expensive():
    pick = choose(_cpu_like(), None, [[1.0] * 12], [0.9], 12, [True])
    assert pick.model_k == 0 and pick.width == 3 and pick.suffix_len == (3,)  # T=4: before the jump at 5


def test_no_proposal_pays_so_a_plain_step():
    compute_bound = CostModel()  # every extra scored token costs 80% of a step
    compute_bound.seed_widths({1: 0.1, 2: 0.18, 3: 0.26, 4: 0.34})
    compute_bound.draft_token_s = 0.03
    pick = choose(compute_bound, [0.5], [[0.6, 0.3]], [0.5], 3, [True])
    assert pick.width == 0 and pick.model_k == 0
    free_token = choose(_cpu_like(), [0.2], [[0.4, 0.2]], [0.3], 12, [True])
    assert free_token.width == 1  # a second scored token costs nothing there: even a weak guess pays


def test_a_good_draft_model_is_used_and_loses_to_a_sure_suffix():
    costs = _cpu_like()
    model = choose(costs, [0.8], [[]], [0.5], 12, [True])
    assert model.model_k >= 1 and model.suffix_len == (0,)
    sure = choose(costs, [0.8], [[1.0] * 12], [0.95], 12, [True])
    assert sure.model_k == 0 and sure.suffix_len[0] > 0  # free drafting beats the model's forwards


def test_a_model_proposal_must_win_by_a_margin():
    """llama.cpp-like CPU costs (4 scored rows for about one, a draft token a third of a
    step): a chat-like acceptance predicts K=1 about 5% above a plain step, which its
    untimed upkeep eats, so the round is a plain step; a code-like acceptance still drafts."""
    from ssdlocal.speculation.adaptive import MODEL_MARGIN

    costs = CostModel()
    costs.seed_widths({1: 0.040, 2: 0.041, 3: 0.042, 4: 0.044, 5: 0.060})
    costs.draft_token_s = 0.014
    gain = expected_tokens(0.45, 1) / (0.041 + 0.014) * 0.040  # K=1 against a plain step
    assert 1.0 < gain < MODEL_MARGIN
    chat = choose(costs, [0.45], [[]], [0.5], 12, [True])
    assert (chat.model_k, chat.width) == (0, 0)
    code = choose(costs, [0.9], [[]], [0.5], 12, [True])
    assert code.model_k >= 2 and code.tokens_per_s * MODEL_MARGIN > 1.5 / 0.040


def _probed_rounds(costs: CostModel, model_rate: float, rounds: int = 64) -> list[int]:
    """The rounds of one call in which an adaptive drafter (K up to 2, a draft model that
    is caught up and accepted at `model_rate`) probes the model."""
    from types import SimpleNamespace

    from ssdlocal.draft.adaptive import AdaptiveDrafter

    drafter = AdaptiveDrafter(
        SimpleNamespace(cached=[100]),
        None,
        k=2,
        pinned=False,
        params=SamplingParams(),
        costs=costs,
        target_vocab=10,
        device="cpu",
    )
    drafter.rows = [SimpleNamespace(length=100)]  # the draft is caught up: a probe is cheap to try
    drafter.acceptance.shared["model"] = model_rate
    probes = []
    for index in range(rounds):
        choice = drafter._choose([True], [()], ["suffix:2"])
        if choice.model_k:
            probes.append(index)
        drafter._since_model = 0 if choice.model_k else drafter._since_model + 1
    return probes


def test_probes_that_do_not_pay_get_rarer_across_calls():
    """A draft model that would pay if accepted often but is accepted rarely is probed at
    round 16 and then 33 rounds later in a first call (the interval doubles); the engine
    keeps the interval with its costs, so the next call of 64 rounds pays no probe at all."""
    costs = CostModel()
    costs.seed_widths({1: 0.1, 2: 0.11, 3: 0.12})  # scored tokens almost free: accepted drafts would pay
    costs.draft_token_s = 0.03
    assert _probed_rounds(costs, 0.1) == [16, 49]
    assert _probed_rounds(costs, 0.1) == [] and costs.probe_every == 64


def test_a_model_that_cannot_pay_at_any_acceptance_is_never_probed():
    """llama.cpp-on-2-cores-like costs (each scored token costs most of a step, a draft
    token 0.6 of one): even all drafts accepted would be slower than plain steps, so
    however long the answer the draft model is never run to measure its acceptance."""
    costs = CostModel()
    costs.seed_widths({1: 0.035, 2: 0.060, 3: 0.077})
    costs.draft_token_s = 0.020
    assert _probed_rounds(costs, 0.1, rounds=300) == []
    assert _probed_rounds(costs, 1.0, rounds=300) == []  # nor with the best acceptance seen so far
    costs.draft_token_s = 0.002  # a draft ten times cheaper: all-accepted K=2 would beat plain steps
    assert _probed_rounds(costs, 0.1) == [16, 49]


def test_a_probe_catch_up_is_not_charged_per_drafted_token():
    """A probe after plain rounds reads the committed tokens the draft lacks (63 here, 0.5 s)
    before its 2 drafts: that reading is paid once, so the draft token cost learnt from the
    round counts only what a steady model round (K+1 tokens read) has; a steady round's
    time is taken whole."""
    from types import SimpleNamespace

    from ssdlocal.draft.adaptive import AdaptiveDrafter, _Round
    from ssdlocal.draft.base import RoundOutcome
    from ssdlocal.speculation.adaptive import Choice

    costs = CostModel()
    model = SimpleNamespace(cached=[100], last_read=(63, 0.5), observe=lambda outcome, adopted: None)
    drafter = AdaptiveDrafter(
        model, None, k=2, pinned=False, params=SamplingParams(), costs=costs, target_vocab=10, device="cpu"
    )
    drafter.last = _Round(Choice(2, (0,), 2, 0.0), ("model",), (2,), ("suffix:2",))
    drafter.observe(RoundOutcome(((1, 2),), (1,), (2,), (True,), draft_s=0.56, verify_s=0.1))
    assert costs.draft_token_s == pytest.approx((0.56 - 0.5 * 60 / 63) / 2)  # 0.04 s of drafting, 0.02 a token
    model.last_read = (3, 0.03)  # the next round's: what every model round reads
    drafter.last = _Round(Choice(2, (0,), 2, 0.0), ("model",), (2,), ("suffix:2",))
    drafter.observe(RoundOutcome(((3, 4, 5),), (2,), (5,), (True,), draft_s=0.07, verify_s=0.1))
    assert costs.draft_token_s == pytest.approx(0.8 * (0.56 - 0.5 * 60 / 63) / 2 + 0.2 * 0.07 / 2)


def test_explored_widths_get_rarer_while_nothing_speculates():
    """A chat whose suffix proposals never pay on CPU-like costs tries a wider step at round
    16, then 33 rounds later (the interval doubles); the engine keeps the interval with its
    costs, so a next call of 64 rounds explores once at most; a round that speculates on
    its merits brings the interval back to 16."""
    from types import SimpleNamespace

    from ssdlocal.draft.adaptive import AdaptiveDrafter
    from ssdlocal.speculation.adaptive import PROBE_EVERY

    costs = CostModel()
    costs.seed_widths({1: 0.1, 2: 0.18, 3: 0.26})  # each scored token costs most of a step

    def call(confidence: float = 0.3, key: str = "suffix:2") -> list[int]:
        drafter = AdaptiveDrafter(
            None, None, k=4, pinned=False, params=SamplingParams(), costs=costs, target_vocab=10, device="cpu"
        )
        drafter.rows = [SimpleNamespace(length=100)]
        tried = []
        for index in range(64):  # widths 4 and 5 were never timed: exploring would time them
            choice = drafter._choose([True], [(confidence,) * 4], [key])
            if choice.width:
                tried.append(index)
            drafter._since_spec = 0 if choice.width else drafter._since_spec + 1
        return tried

    assert call() == [16, 49]
    assert len(call()) <= 1 and costs.explore_every >= 4 * PROBE_EVERY
    assert call(1.0, "suffix:16") and costs.explore_every == PROBE_EVERY  # a sure proposal speculates


def test_flat_gpu_costs_propose_long():
    costs = CostModel()
    costs.seed(0.005, 0.0055, 13, 0.001)  # a memory-bound step: 13 tokens cost 1.1x one
    pick = choose(costs, [0.9], [[]], [0.5], 12, [True])
    assert pick.model_k >= 6


def test_costs_replace_a_first_sample_and_interpolate():
    costs = CostModel()
    costs.observe_target(1, 0.1)
    costs.observe_target(5, 9.0)  # a first call at a new size pays one-time costs
    costs.observe_target(5, 0.3)
    assert costs.target_s(5) == pytest.approx(0.3) and costs.target_s(3) == pytest.approx(0.2)
    explore = choose(costs, None, [[1.0] * 8], [0.9], 8, [True], explore=True)
    assert explore.width == 8  # the least measured width (never measured) is tried


def test_acceptance_is_per_row_with_a_shared_prior():
    shared: dict = {}
    first = Acceptance(shared)
    for _ in range(10):
        first.observe(0, "model", 4, 4)
    assert first.rate(0, "model") > 0.95 and first.rate(1, "model") > 0.9  # row 1 inherits the prior
    later = Acceptance(shared)  # a later call of the same engine
    assert later.rate(0, "model") > 0.9
    assert suffix_key(3) == "suffix:2" and suffix_key(20) == "suffix:16"


def test_repeatable_pins_k_and_drops_what_depends_on_history():
    spec = SpecConfig(mode=Mode.SD, k=12, adaptive_k=True, draft=draft_of("d"))
    fixed = repeatable(spec)
    assert fixed.k == SpecConfig.k and not fixed.adaptive_k and fixed.draft.suffix is None
    assert repeatable(SpecConfig(mode=Mode.SD, draft=SuffixDraft())).draft.use_memory is False


def test_repeatable_pins_what_ssd_would_choose_by_timing_or_history():
    """An automatic fan-out follows measured timing and the automatic backup too, the
    suffix backup follows earlier requests: a seeded SSD request gets fixed ones."""
    ssd = repeatable(SpecConfig(mode=Mode.SSD, k=3, draft=draft_of("d")))
    assert (ssd.fan_out, ssd.fan_out_miss, ssd.backup) == ((1, 1, 1, 1), (1, 1, 1, 1), "jit")
    mine = repeatable(SpecConfig(mode=Mode.SSD, k=3, draft=draft_of("d"), fan_out=(2, 2, 2, 3), backup="ngram"))
    assert (mine.fan_out, mine.fan_out_miss, mine.backup) == ((2, 2, 2, 3), (2, 2, 2, 3), "ngram")
    assert repeatable(SpecConfig(mode=Mode.SSD, k=3, draft=draft_of("d"), backup="suffix")).backup == "jit"


# --------------------------------------------------------------------------- the engine
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)
PROMPTS = [["def f(x):\n    return x + 1\n" * 3], ["the cat", "hello world, hello world, hello"]]


def _run(engine: Engine, prompts, spec: SpecConfig):
    done = [e for e in engine.generate(prompts, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
    return [o.token_ids for o in done.outputs], done.stats


@pytest.fixture(scope="module")
def engine(tiny_dir):
    d = str(tiny_dir["draft_qwen2"])
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["qwen2"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(d), backup="suffix"),
        pin_cpus=False,
    )
    with Engine(config) as eng:
        yield eng


SPECS = {
    "suffix, K per round": dict(mode=Mode.SD, k=12, adaptive_k=True, draft=SuffixDraft()),
    "suffix, K=4": dict(mode=Mode.SD, k=4, draft=SuffixDraft()),
    "hybrid, K per round": dict(mode=Mode.SD, k=12, adaptive_k=True),
    "hybrid, K=3": dict(mode=Mode.SD, k=3),
    "model only, K per round": dict(mode=Mode.SD, k=8, adaptive_k=True, model_only=True),
    "SSD, suffix backup": dict(mode=Mode.SSD, k=3, backup="suffix", fan_out=(1, 1, 1, 1), fan_out_miss=(1, 1, 1, 1)),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_combination_equals_ar_over_calls(engine, name):
    kw = dict(SPECS[name])
    draft = kw.pop("draft", None)
    if draft is None:
        draft = engine.config.spec.draft
        if kw.pop("model_only", False):
            draft = draft_of(engine.config.spec.draft.model.path, suffix=False)
    spec = SpecConfig(draft=draft, **kw)
    for prompts in PROMPTS * 2:  # the second pass finds the first's answers in the memory
        want, _ = _run(engine, prompts, SpecConfig(mode=Mode.AR))
        got, stats = _run(engine, prompts, spec)
        assert got == want, (name, prompts)
    if spec.mode is Mode.SD and name != "model only, K per round":
        assert stats["rows_by_source"].get("suffix", 0) > 0  # the suffix proposals were used
    assert len(engine.suffix_memory) > 0


def test_stats_carry_k_and_source_per_round(engine):
    spec = SpecConfig(mode=Mode.SD, k=12, adaptive_k=True, draft=SuffixDraft())
    _, stats = _run(engine, PROMPTS[0], spec)
    assert sum(stats["rounds_by_k"].values()) == stats["rounds"]
    assert set(stats["rows_by_source"]) <= {"suffix", "model", "none"}
    assert 0 <= stats["mean_k"] <= 12


def test_memory_is_private_to_an_engine_and_bounded(tiny_dir):
    t = str(tiny_dir["qwen2"])
    small = MemorySettings(max_sequences=2, max_tokens=10_000)
    with (
        Engine(EngineConfig(ModelSpec(t, dtype="float32"), SpecConfig(memory=small))) as a,
        Engine(EngineConfig(ModelSpec(t, dtype="float32"))) as b,
    ):
        for p in ("one", "two", "three"):
            _run(a, [p], SpecConfig(mode=Mode.AR))
        assert len(a.suffix_memory) == 2 and len(b.suffix_memory) == 0


def test_the_memory_persists_per_model_when_asked(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    kept = MemorySettings(persist=True)
    for name in ("qwen2", "qwen2", "llama"):
        with Engine(EngineConfig(ModelSpec(str(tiny_dir[name]), dtype="float32"), SpecConfig(memory=kept))) as eng:
            seen = len(eng.suffix_memory)
            _run(eng, ["remember me"], SpecConfig(mode=Mode.AR))
        if name == "qwen2" and seen:
            assert seen == 1  # the first engine's answer, loaded by the second
    assert seen == 0  # the llama engine does not see the qwen2 engine's memory
    assert len(list((tmp_path / "suffix").glob("*.json"))) == 2
