"""Greedy exactness end to end: SD and SSD emit exactly AR's tokens (fp32, temperature 0).

Covers K, batch sizes (prompts of different lengths), draft kinds (noisy copy, an
unrelated small model, n-gram), Llama / Qwen2 / Qwen3 targets, SSD fan-outs and
backups, forced all-hit / all-miss speculation caches, stop strings, EOS and
max-new-tokens truncation, and the sanity of the reported stats.

Engines are module-scoped and reused with per-call `spec=` overrides, so each SSD
draft worker is spawned once. Torch runs one thread in this process and in the workers
while these tests run: with pin_cpus=False the worker's threads and ours would otherwise
oversubscribe the cores and spin-wait (SSD gets ~100x slower on a 2-core machine).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.events import DoneEvent, RoundEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of
from ssdlocal.core.config import ModelDraft

PROMPTS_1 = ["The quick brown fox"]
PROMPTS_3 = [
    "hello world, def foo(x):",
    "the cat",
    "Once upon a time there was a little model that wanted to",
]
MAX_NEW = 28
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


class Engines:
    """One Engine per (target, draft), created on first use, closed at module end."""

    def __init__(self, dirs) -> None:
        self.dirs = dirs
        self._engines: dict[tuple[str, str | None], Engine] = {}

    def path(self, name: str | None) -> str | None:
        if name is None or name in ("ngram", "suffix"):
            return name
        return str(self.dirs[name])

    def get(self, target: str, draft: str | None) -> Engine:
        key = (target, draft)
        if key not in self._engines:
            draft_path = self.path(draft)
            mode = Mode.AR if draft is None else Mode.SD
            cfg = EngineConfig(
                target=ModelSpec(self.path(target), dtype="float32"),
                spec=SpecConfig(mode=mode, k=2, draft=draft_of(draft_path)),
                pin_cpus=False,
            )
            self._engines[key] = Engine(cfg)
        return self._engines[key]

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


@pytest.fixture(scope="module")
def engines(tiny_dir):
    pool = Engines(tiny_dir)
    yield pool
    pool.close()


def run(engine: Engine, prompts, params: SamplingParams, spec: SpecConfig | None = None):
    """Generate; returns (DoneEvent, [RoundEvent])."""
    rounds, done = [], None
    for ev in engine.generate(prompts, params, spec=spec):
        if isinstance(ev, RoundEvent):
            rounds.append(ev)
        elif isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    return done, rounds


_AR_CACHE: dict = {}


def ar_reference(engines: Engines, target: str, prompts, params: SamplingParams) -> DoneEvent:
    key = (target, tuple(prompts), params)
    if key not in _AR_CACHE:
        done, rounds = run(engines.get(target, None), prompts, params, SpecConfig(mode=Mode.AR))
        assert all(n == () or set(n) == {0} for n in (r.n_drafted for r in rounds))
        _AR_CACHE[key] = done
    return _AR_CACHE[key]


def spec_for(engines: Engines, mode: Mode, draft: str, k: int, **kw) -> SpecConfig:
    return SpecConfig(mode=mode, k=k, draft=draft_of(engines.path(draft)), **kw)


def assert_same(ar: DoneEvent, out: DoneEvent, what: str) -> None:
    assert len(ar.outputs) == len(out.outputs)
    for b, (a, o) in enumerate(zip(ar.outputs, out.outputs)):
        assert o.token_ids == a.token_ids, f"{what}: row {b} diverges from AR"
        assert o.text == a.text, f"{what}: row {b} text differs"
        assert o.finish_reason == a.finish_reason, f"{what}: row {b} finish reason differs"


def check_stats(
    done: DoneEvent, rounds: list[RoundEvent], k: int, *, model_draft: bool, full_depth: bool = True
) -> None:
    """The metric definitions (docs/architecture.md §3) hold on a finished run.

    model_draft: every row-round drafted (a draft model, not n-gram / no backup);
    full_depth: ... exactly K tokens (SSD with automatic fan-out may serve a cache hit
    from a branch cut short when the outcome arrived early)."""
    s = done.stats
    assert s["rounds"] == len(rounds)
    assert s["tokens"] == sum(len(o.token_ids) for o in done.outputs)
    row_rounds = sum(len(r.n_drafted) for r in rounds)
    drafted_row_rounds = sum(1 for r in rounds for n in r.n_drafted if n > 0)
    hist = s["accepted_len_hist"]
    assert len(hist) == k + 1
    assert sum(hist) == drafted_row_rounds  # one entry per row-round that drafted
    if model_draft:
        assert sum(hist) == row_rounds  # a draft model always drafts
        assert all(min(r.n_drafted) >= 1 for r in rounds)
        if full_depth:  # the model's proposals (a row may take its suffix proposal instead)
            assert all(
                n == k
                for r in rounds
                for n, src in zip(r.n_drafted, r.sources or ["model"] * len(r.n_drafted))
                if src == "model"
            )
    for r in rounds:
        assert all(0 <= a <= n <= k for a, n in zip(r.n_accepted, r.n_drafted))
    drafted = sum(sum(r.n_drafted) for r in rounds)
    accepted = sum(sum(r.n_accepted) for r in rounds)
    if drafted:
        assert 0.0 <= s["acceptance_rate"] <= 1.0
        assert s["acceptance_rate"] == pytest.approx(accepted / drafted)
    else:
        assert s["acceptance_rate"] is None
    if row_rounds:
        assert 1.0 <= s["mean_accepted_len"] <= k + 1
        # every token after the prefill's first one is emitted by a round
        emitted = s["tokens"] - len(done.outputs)
        assert s["mean_accepted_len"] == pytest.approx(emitted / row_rounds)
    ppa = s["per_position_acceptance"]
    assert len(ppa) == k
    assert all(x is None or 0.0 <= x <= 1.0 for x in ppa)
    if model_draft and row_rounds:
        assert ppa[0] is not None
    if "cache_hit_rate" in s:
        assert 0.0 <= s["cache_hit_rate"] <= 1.0
        hits = sum(sum(r.ssd.cache_hit) for r in rounds)
        assert s["cache_hit_rate"] == pytest.approx(hits / row_rounds)
        all_hit_rounds = sum(all(r.ssd.cache_hit) for r in rounds)
        assert s["round_hit_rate"] == pytest.approx(all_hit_rounds / len(rounds))


# ----------------------------------------------------------------- SD == AR
@pytest.mark.parametrize("draft", ["draft_llama", "small_llama", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_3], ids=["b1", "b3"])
def test_sd_equals_ar_llama(engines, draft, k, prompts):
    ar = ar_reference(engines, "llama", prompts, GREEDY)
    spec = spec_for(engines, Mode.SD, draft, k)
    done, rounds = run(engines.get("llama", draft), prompts, GREEDY, spec)
    assert_same(ar, done, f"SD draft={draft} k={k}")
    check_stats(done, rounds, k, model_draft=draft != "ngram")
    assert all(len(o.token_ids) == MAX_NEW and o.finish_reason == "length" for o in done.outputs)


def test_sd_acceptance_reflects_draft_quality(engines):
    """The noisy copy agrees with the target far more often than the unrelated model."""
    rates = {}
    for draft in ("draft_llama", "small_llama"):
        spec = SpecConfig(mode=Mode.SD, k=3, draft=draft_of(engines.path(draft), suffix=False))  # the model only
        done, _ = run(engines.get("llama", draft), PROMPTS_3, GREEDY, spec)
        rates[draft] = done.stats["acceptance_rate"]
    assert rates["draft_llama"] > 0.4
    assert rates["small_llama"] < 0.2
    assert rates["draft_llama"] > rates["small_llama"] + 0.3


@pytest.mark.parametrize(
    ("target", "draft", "k"),
    [
        ("qwen2", "draft_qwen2", 3),
        ("qwen2", "draft_qwen2", 1),
        ("qwen3", "ngram", 3),
        ("qwen3", "ngram", 2),
        ("qwen2", "ngram", 4),
    ],
)
def test_sd_equals_ar_other_families(engines, target, draft, k):
    for prompts in (PROMPTS_1, PROMPTS_3):
        ar = ar_reference(engines, target, prompts, GREEDY)
        done, rounds = run(engines.get(target, draft), prompts, GREEDY, spec_for(engines, Mode.SD, draft, k))
        assert_same(ar, done, f"SD {target} draft={draft} k={k}")
        check_stats(done, rounds, k, model_draft=draft != "ngram")


def test_ngram_draft_proposes_and_is_verified(engines):
    """Prompt lookup does propose on repetitive text, and SD stays exact with it."""
    prompts = ["the cat the cat the cat the cat the cat the"]
    ar = ar_reference(engines, "llama", prompts, GREEDY)
    done, rounds = run(engines.get("llama", "ngram"), prompts, GREEDY, spec_for(engines, Mode.SD, "ngram", 4))
    assert_same(ar, done, "SD ngram repetitive prompt")
    assert sum(sum(r.n_drafted) for r in rounds) > 0
    check_stats(done, rounds, 4, model_draft=False)


@pytest.mark.parametrize("draft", ["ngram", "suffix"])
def test_point_mass_rounds_are_as_wide_as_the_longest_proposal(engines, monkeypatch, draft):
    """With K pinned, an n-gram or suffix round scores the pending token plus the longest
    row's proposal, not K+1 tokens: where no row matches it is a plain 1-token step (on a
    CPU a 9-token step costs several 1-token ones). Output stays equal to AR."""
    prompts = ["the cat the cat the cat the cat the cat the", "one two three four five six seven"]
    engine = engines.get("llama", draft)
    widths: list[int] = []
    step = engine.runner.step

    def recording(ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return step(ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", recording)
    done, rounds = run(engine, prompts, GREEDY, spec_for(engines, Mode.SD, draft, 8))
    assert_same(ar_reference(engines, "llama", prompts, GREEDY), done, f"SD {draft} K=8")
    assert widths == [1 + max(r.n_drafted) for r in rounds]
    assert min(widths) == 1 and max(widths) > 1  # plain steps and proposals both happened


# ----------------------------------------------------------------- SSD == AR
def fan(k: int, kind: str) -> tuple[int, ...] | None:
    """Fixed fan-out lists of length K+1 (None = auto)."""
    if kind == "auto":
        return None
    if kind == "ones":
        return (1,) * (k + 1)
    if kind == "decay":  # 3,2,2,1,1 for K=4
        base = [3, 2, 2] + [1] * max(0, k - 2)
        return tuple(base[:k]) + (1,)
    raise ValueError(kind)


@pytest.mark.parametrize("backup", ["jit", "ngram", "none", "auto"])
@pytest.mark.parametrize("fan_kind", ["ones", "decay", "auto"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_3], ids=["b1", "b3"])
def test_ssd_equals_ar(engines, backup, fan_kind, k, prompts):
    ar = ar_reference(engines, "llama", prompts, GREEDY)
    f = fan(k, fan_kind)
    spec = spec_for(engines, Mode.SSD, "draft_llama", k, fan_out=f, fan_out_miss=f, backup=backup)
    done, rounds = run(engines.get("llama", "draft_llama"), prompts, GREEDY, spec)
    assert_same(ar, done, f"SSD k={k} fan={fan_kind} backup={backup}")
    check_stats(done, rounds, k, model_draft=backup == "jit", full_depth=f is not None)
    assert not any(rounds[0].ssd.cache_hit)  # nothing was pre-speculated before round 0
    assert set(rounds[0].n_drafted) == {k}  # round 0 is drafted just-in-time, full depth
    used = done.stats["backup_used"]
    if backup != "auto":
        assert set(used) <= {backup}
    else:
        assert set(used) <= {"jit", "ngram"}
    if backup == "none":
        # a miss proposes nothing: those rows emit exactly the target's bonus token
        for r in rounds[1:]:
            for hit, n in zip(r.ssd.cache_hit, r.n_drafted):
                assert hit or n == 0


@pytest.mark.parametrize("backup", ["jit", "none"])
@pytest.mark.parametrize("k", [2, 4])
def test_ssd_equals_ar_unrelated_draft(engines, backup, k):
    """A draft that mostly disagrees: misses dominate, outputs stay exact."""
    ar = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    spec = spec_for(
        engines, Mode.SSD, "small_llama", k, fan_out=fan(k, "decay"), fan_out_miss=fan(k, "decay"), backup=backup
    )
    done, rounds = run(engines.get("llama", "small_llama"), PROMPTS_3, GREEDY, spec)
    assert_same(ar, done, f"SSD small_llama k={k} backup={backup}")
    check_stats(done, rounds, k, model_draft=backup == "jit")


def test_ssd_equals_ar_qwen2(engines):
    for prompts in (PROMPTS_1, PROMPTS_3):
        ar = ar_reference(engines, "qwen2", prompts, GREEDY)
        spec = spec_for(engines, Mode.SSD, "draft_qwen2", 3, backup="auto")
        done, rounds = run(engines.get("qwen2", "draft_qwen2"), prompts, GREEDY, spec)
        assert_same(ar, done, "SSD qwen2")
        check_stats(done, rounds, 3, model_draft=False)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_3], ids=["b1", "b3"])
@pytest.mark.parametrize("only_last", [False, True], ids=["ones", "last-only"])
def test_ssd_forced_all_hit(engines, k, prompts, only_last):
    """Draft = the target itself, greedy: every draft is accepted and the bonus is the
    draft's own top-1 after position K, which F_K >= 1 caches. So every round after the
    first (drafted just-in-time) is a cache hit."""
    ar = ar_reference(engines, "llama", prompts, GREEDY)
    f = (0,) * k + (1,) if only_last else (1,) * (k + 1)
    spec = spec_for(engines, Mode.SSD, "llama", k, fan_out=f, fan_out_miss=f, backup="none")
    done, rounds = run(engines.get("llama", "llama"), prompts, GREEDY, spec)
    assert_same(ar, done, f"SSD all-hit k={k}")
    check_stats(done, rounds, k, model_draft=True)
    s = done.stats
    assert s["acceptance_rate"] == 1.0
    assert s["accepted_len_hist"][:k] == [0] * k
    assert not any(rounds[0].ssd.cache_hit)
    assert len(rounds) > 2
    assert all(all(r.ssd.cache_hit) for r in rounds[1:])
    # the stats say the same: every row-round but the first round's is a hit
    batch = len(prompts)
    row_rounds = sum(len(r.n_drafted) for r in rounds)
    assert s["cache_hit_rate"] == pytest.approx((row_rounds - batch) / row_rounds)
    assert s["round_hit_rate"] == pytest.approx((len(rounds) - 1) / len(rounds))
    assert s["backup_used"] == {}  # no round after the first needed a backup
    assert s["tokens_per_round_hit"] > 1.0


@pytest.mark.parametrize("backup", ["jit", "ngram", "none", "auto"])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_3], ids=["b1", "b3"])
def test_ssd_forced_all_miss(engines, backup, prompts):
    """Fan-out zero everywhere: nothing is cached, every round is served by the backup."""
    k = 3
    ar = ar_reference(engines, "llama", prompts, GREEDY)
    zeros = (0,) * (k + 1)
    for draft in ("draft_llama", "llama"):
        spec = spec_for(engines, Mode.SSD, draft, k, fan_out=zeros, fan_out_miss=zeros, backup=backup)
        done, rounds = run(engines.get("llama", draft), prompts, GREEDY, spec)
        assert_same(ar, done, f"SSD all-miss draft={draft} backup={backup}")
        check_stats(done, rounds, k, model_draft=backup == "jit")
        assert done.stats["cache_hit_rate"] == 0.0
        assert done.stats["round_hit_rate"] == 0.0
        assert not any(any(r.ssd.cache_hit) for r in rounds)
        missed_rounds = len(rounds) - 1  # round 0 is drafted just-in-time, not a backup
        assert sum(done.stats["backup_used"].values()) == missed_rounds


def test_ssd_mixed_hits_and_misses(engines):
    """The noisy draft: some rounds hit, some miss, and hits carry accepted tokens."""
    k = 4
    ar = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    spec = spec_for(
        engines, Mode.SSD, "draft_llama", k, fan_out=(3, 2, 2, 1, 1), fan_out_miss=(3, 2, 2, 1, 1), backup="jit"
    )
    params = replace(GREEDY, max_new_tokens=48)
    ar = ar_reference(engines, "llama", PROMPTS_3, params)
    done, rounds = run(engines.get("llama", "draft_llama"), PROMPTS_3, params, spec)
    assert_same(ar, done, "SSD mixed")
    check_stats(done, rounds, k, model_draft=True)
    s = done.stats
    assert 0.0 < s["cache_hit_rate"] < 1.0
    assert s["backup_used"].get("jit", 0) > 0
    assert s["tokens_per_round_hit"] is not None and s["tokens_per_round_miss"] is not None


def test_engine_default_spec_runs_ssd(tiny_dir):
    """The usage of the README: mode fixed in the EngineConfig, no per-call override."""
    draft = str(tiny_dir["draft_llama"])
    cfg = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(
            mode=Mode.SSD, k=4, draft=ModelDraft(ModelSpec(draft, dtype="float32")), fan_out=None, backup="jit"
        ),
        pin_cpus=False,
    )
    params = replace(GREEDY, max_new_tokens=12)
    with Engine(cfg) as eng:
        ar, _ = run(eng, PROMPTS_3, params, SpecConfig(mode=Mode.AR))
        first, _ = run(eng, PROMPTS_3, params)
        second, _ = run(eng, PROMPTS_1 * 2, params)  # another batch shape on the same worker
        third, _ = run(eng, PROMPTS_3, params)
    assert_same(ar, first, "SSD (config spec)")
    assert_same(first, third, "SSD rerun")
    assert second.outputs[0].token_ids == second.outputs[1].token_ids


# ----------------------------------------------------------------- stop rules
MODES = [
    ("sd", "draft_llama", 3, "auto"),
    ("sd", "ngram", 4, "auto"),
    ("ssd", "draft_llama", 3, "jit"),
    ("ssd", "draft_llama", 2, "none"),
    ("ssd", "llama", 4, "ngram"),
]


def _modes(engines, target="llama"):
    for mode, draft, k, backup in MODES:
        if target != "llama" and draft == "llama":
            continue  # the self-draft needs its own worker; one per other target is enough
        yield (
            f"{mode}/{draft}/k{k}/{backup}",
            engines.get(target, draft),
            spec_for(engines, Mode(mode), draft, k, backup=backup),
        )


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_truncation(engines, max_new):
    """Rounds that would overshoot the budget are cut at exactly max_new_tokens."""
    params = replace(GREEDY, max_new_tokens=max_new)
    ar = ar_reference(engines, "llama", PROMPTS_3, params)
    long = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    for a, full in zip(ar.outputs, long.outputs):
        assert a.token_ids == full.token_ids[:max_new]
        assert a.finish_reason == "length"
    for what, eng, spec in _modes(engines):
        done, rounds = run(eng, PROMPTS_3, params, spec)
        assert_same(ar, done, f"{what} max_new={max_new}")
        assert all(len(o.token_ids) == max_new for o in done.outputs)
        if max_new == 1:
            assert rounds == []  # the prefill alone produced the only token


def _stop_string(text: str, start: int) -> str:
    """A 3-character piece of `text` at or after `start` that occurs nowhere earlier
    and has no replacement characters (partial UTF-8)."""
    for i in range(start, len(text) - 3):
        piece = text[i : i + 3]
        if "\ufffd" not in piece and text.find(piece) == i and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(engines):
    full = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    stops = tuple(_stop_string(o.text, len(o.text) // 3) for o in full.outputs)
    params = replace(GREEDY, stop=stops)
    ar = ar_reference(engines, "llama", PROMPTS_3, params)
    for a, f in zip(ar.outputs, full.outputs):
        assert a.finish_reason == "stop"
        assert f.text.startswith(a.text)
        assert not any(s in a.text for s in stops)
        assert len(a.token_ids) < len(f.token_ids)
        assert a.token_ids == f.token_ids[: len(a.token_ids)]
    for what, eng, spec in _modes(engines):
        done, _ = run(eng, PROMPTS_3, params, spec)
        assert_same(ar, done, f"{what} stop")
    # a stop string that never occurs changes nothing
    never = replace(GREEDY, stop=("\x00never\x00",))
    for what, eng, spec in _modes(engines):
        done, _ = run(eng, PROMPTS_3, never, spec)
        assert_same(full, done, f"{what} unused stop")


@pytest.fixture(scope="module")
def eos_target(engines, tiny_dir, tmp_path_factory):
    """The llama target with one extra EOS id: a token its greedy output for prompt 0
    first emits at generated index >= 4 (random tiny models rarely emit token 0)."""
    full = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    generated = full.outputs[0].token_ids
    index = next(i for i in range(4, len(generated)) if generated.index(generated[i]) == i)
    eos = generated[index]
    out = tmp_path_factory.mktemp("eos") / "llama_eos"
    shutil.copytree(tiny_dir["llama"], out)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [0, eos]
    gen_path.write_text(json.dumps(gen))
    engines.dirs = {**engines.dirs, "llama_eos": out}
    return index


def test_eos_stops_every_mode(engines, eos_target):
    index = eos_target
    params = replace(GREEDY, ignore_eos=False)
    ar = ar_reference(engines, "llama_eos", PROMPTS_3, params)
    row0 = ar.outputs[0]
    assert row0.finish_reason == "eos"
    assert len(row0.token_ids) == index + 1  # the EOS token itself is the last one kept
    assert {o.finish_reason for o in ar.outputs} <= {"eos", "length"}
    for what, eng, spec in _modes(engines, target="llama_eos"):
        done, _ = run(eng, PROMPTS_3, params, spec)
        assert_same(ar, done, f"{what} eos")
    # ignore_eos keeps going past it, identically
    full = ar_reference(engines, "llama_eos", PROMPTS_3, GREEDY)
    assert full.outputs[0].finish_reason == "length"
    assert full.outputs[0].token_ids[: index + 1] == row0.token_ids
    for what, eng, spec in _modes(engines, target="llama_eos"):
        done, _ = run(eng, PROMPTS_3, GREEDY, spec)
        assert_same(full, done, f"{what} ignore_eos")


def test_eos_and_stop_and_length_mixed_in_one_batch(engines, eos_target):
    """Rows finishing for different reasons in the same batch, in every mode."""
    index = eos_target
    params = SamplingParams(temperature=0.0, max_new_tokens=index + 8)
    plain = ar_reference(engines, "llama_eos", PROMPTS_3, params)
    stop = _stop_string(plain.outputs[1].text, len(plain.outputs[1].text) // 3)
    params = replace(params, stop=(stop,))
    ar = ar_reference(engines, "llama_eos", PROMPTS_3, params)
    reasons = [o.finish_reason for o in ar.outputs]
    assert reasons[0] == "eos"
    assert reasons[1] == "stop"
    assert reasons[2] in ("eos", "stop", "length")
    for what, eng, spec in _modes(engines, target="llama_eos"):
        done, _ = run(eng, PROMPTS_3, params, spec)
        assert_same(ar, done, f"{what} mixed finish")


# ----------------------------------------------------------------- bonus == rejected draft
def _reject_all(logits, draft_tokens, q, params, generator, n_draft=None):
    """A valid greedy verdict that rejects every draft: the bonus is the target's argmax
    at the first position, which often IS the first draft. verify's RESIDUAL_EPS fallback
    can produce the same situation at T > 0 (bonus drawn from p after a rejection)."""
    from ssdlocal.core.verify import Verdict

    batch = logits.shape[0]
    return Verdict(torch.zeros(batch, dtype=torch.long), torch.argmax(logits[:, 0], dim=-1))


@pytest.mark.parametrize(
    ("mode", "draft", "backup"),
    [
        ("sd", "draft_llama", "auto"),
        ("sd", "llama", "auto"),
        ("sd", "ngram", "auto"),
        ("ssd", "draft_llama", "jit"),
        ("ssd", "llama", "none"),
        ("ssd", "llama", "ngram"),
    ],
)
def test_bonus_equal_to_rejected_draft_keeps_caches_consistent(engines, monkeypatch, mode, draft, backup):
    """When the bonus equals the rejected draft token, target and draft caches already
    hold that token; its logits are still needed for the next round, so it must be
    fed again. Output must stay exactly AR's."""
    import ssdlocal.core.verify as verify_mod  # every verification goes through verify_groups -> verify_logits

    ar = ar_reference(engines, "llama", PROMPTS_3, GREEDY)
    monkeypatch.setattr(verify_mod, "verify_logits", _reject_all)
    spec = spec_for(engines, Mode(mode), draft, 3, backup=backup)
    done, rounds = run(engines.get("llama", draft), PROMPTS_3, GREEDY, spec)
    assert_same(ar, done, f"{mode} {draft} {backup} reject-all")
    if draft != "ngram":
        # the situation did occur: some rounds drafted the target's own next token
        assert any(r.n_drafted and r.n_drafted[0] > 0 for r in rounds)


def test_sync_held_keeps_the_common_prefix_but_never_the_last_committed_token():
    from ssdlocal.backends.base import sync_held

    held = [1, 2, 3, 4, 5]
    sync_held(held, [1, 2, 3, 9, 9, 9])  # diverges at index 3
    assert held == [1, 2, 3]
    held = [1, 2, 3, 4]
    sync_held(held, [1, 2, 3, 4])  # all cached, but the last token must be fed again
    assert held == [1, 2, 3]
    held = [1, 2]
    sync_held(held, [1, 2, 3, 4])  # a prefix of committed stays as it is
    assert held == [1, 2]
