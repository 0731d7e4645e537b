"""What the race and the chat say beside their numbers (tui/facts.py, tui/load.py, the
race's verdict and timing lines), and that the race is exact on kernels whose logits part
with the call width.

The kernels are the fake llama.cpp of test_llamacpp_alike.py, whose logits shift with the
call's kernel family: there greedy SD leaves AR, and the race's `exact_config`
(batch-invariant steps) makes the recorded AR and SD runs identical. The machine's load is
read from a fake /proc: a child's CPU counts as ours, another process's as other load.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.fake_engine import FakeEngine, FakeMeter
from support.llamacpp_fakes import fake, shaped, tok_dir, tokenizer, vocab  # noqa: F401 - fixtures

from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.tui import facts, load
from ssdlocal.tui.race import RaceRow, identical_verdict, race_specs, record_mode, summarize, timing_note


def _llamacpp(target="t.gguf", draft="d.gguf", alike=False, adaptive=True) -> EngineConfig:
    spec = SpecConfig(mode=Mode.SSD, k=4, adaptive_k=adaptive, draft=ModelDraft(ModelSpec(draft, backend="llamacpp")))
    return EngineConfig(target=ModelSpec(target, backend="llamacpp", batch_invariant=alike), spec=spec)


def _torch(dtype="bfloat16", draft_device="cpu") -> EngineConfig:
    spec = SpecConfig(mode=Mode.SSD, k=4, draft=ModelDraft(ModelSpec("d", draft_device, dtype)))
    return EngineConfig(target=ModelSpec("t", "cuda:0" if draft_device != "cpu" else "cpu", dtype), spec=spec)


# ----------------------------------------------------------------------------- exactness
def test_the_race_turns_batch_invariant_steps_on_where_kernels_part_with_the_call_width():
    plain = _llamacpp()
    exact = facts.exact_config(plain)
    assert exact.target.batch_invariant and not plain.target.batch_invariant
    assert "batch-invariant" in facts.exact_form(exact) and facts.exact_form(plain) is None
    assert facts.exact_config(_torch()) == _torch()  # torch kernels: nothing to change
    # the known cause, by kernels
    assert "llama.cpp's CPU kernels" in facts.divergence_cause(plain)
    assert "near-tie in bfloat16" in facts.divergence_cause(_torch())
    assert "no known cause" in facts.divergence_cause(_torch("float32"))
    assert "no known cause" in facts.divergence_cause(exact)


def test_race_runs_on_shifting_kernels_differ_without_it_and_agree_with_it(shaped):
    from ssdlocal.engine import Engine

    _lib, target, draft = shaped
    params = SamplingParams(max_new_tokens=12)
    config = _llamacpp(target, draft, adaptive=False)
    config = replace(
        config, spec=replace(config.spec, mode=Mode.SD, k=3), target=replace(config.target, dtype="float32")
    )
    outputs = {}
    for name, cfg in (("default", config), ("race", facts.exact_config(config))):
        with Engine(cfg) as engine:
            ids = engine.encode("the cat", False)
            runs = [record_mode(engine, ids, params, s, meter=FakeMeter()) for s in race_specs(cfg.spec)[:2]]
        rows = summarize(runs)
        outputs[name] = rows[1]
        verdict = identical_verdict(rows, True, facts.divergence_cause(cfg))
        if name == "default":
            assert rows[1].identical is False and rows[1].first_diff is not None
            assert f"SD from token {rows[1].first_diff}" in verdict and "llama.cpp's CPU kernels" in verdict
    assert outputs["race"].identical is True


# ----------------------------------------------------------------------------- hardware, auto
def test_where_the_draft_runs_and_what_auto_picks(monkeypatch):
    monkeypatch.setattr(facts, "_cores", lambda: 2)
    shares, said = facts.hardware(replace(_llamacpp(), pin_cpus=False))
    assert shares and said == "its draft shares the target's CPU: SSD splits its 2 cores and one memory system"
    shares, said = facts.hardware(_torch(draft_device="cuda:1"))
    assert not shares and "hardware of its own (cuda:1; target on cuda:0)" in said
    assert facts.draft_place(_torch(draft_device="cuda:1")) == "own: cuda:1"
    assert facts.draft_place(_llamacpp()) == "shares the CPU"
    # auto: plain decoding on llama.cpp's CPU kernels by default; SD with the race's steps
    said = [(who, c.mode) for who, c in facts.auto_choices(facts.exact_config(_llamacpp()), _llamacpp())]
    assert said == [("", Mode.AR), ("with --batch-invariant, as this race runs", Mode.SD)]
    assert [c.mode for _, c in facts.auto_choices(_torch(draft_device="cuda:1"))] == [Mode.SSD]
    assert facts.auto_choices(_torch())[0][1] is None  # K pinned, CPU shared: a calibration decides
    reason = facts.answer_reason(_llamacpp(), Mode.SD, facts.auto_choices(_llamacpp())[0][1])
    assert reason.startswith("SD picked in the chat") and "auto picks AR" in reason and "near-ties" in reason


def test_the_ssd_pane_projects_hardware_of_its_own():
    from ssdlocal.speculation.projection import ProjectionInputs, ssd_speedup

    engine = FakeEngine()
    ids = engine.encode("hi", chat=True)
    params = SamplingParams(max_new_tokens=40)
    runs = [record_mode(engine, ids, params, s, clock=engine.clock) for s in race_specs(engine.config.spec)]
    speedup, ratio = facts.projected_ssd(*(r.stats for r in runs), 4)
    sd, ssd, ar = runs[1].stats, runs[2].stats, runs[0].stats
    assert ratio == pytest.approx(sd.draft_ms / (4 * sd.rounds) / ar.verify_ms_per_round)
    inputs = ProjectionInputs(4, sd.mean_accepted_len, ssd.cache_hit_rate)
    expected = ssd_speedup(
        inputs.p_hit,
        max(ssd.ssd.tokens_per_round_hit, sd.mean_accepted_len),
        ssd.ssd.tokens_per_round_miss,
        4,
        ratio,
        4,
    )
    assert speedup == pytest.approx(expected)
    note = facts.ssd_note(engine.config, runs)
    assert "its draft shares the target's CPU" in note and f"expects {speedup:.2f}× AR" in note


# ----------------------------------------------------------------------------- load
def _proc(root, busy: int, stats: dict[int, tuple[int, int]]) -> None:
    """A fake /proc: the machine's busy ticks, and each process's (ppid, cpu ticks)."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 1000 0 0 0 0 0 0\ncpu0 0 0 0 0\n")
    for pid, (ppid, ticks) in stats.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(ticks), "0", "0", "0"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} (name with ) inside) " + " ".join(fields))


def test_other_load_is_the_machine_minus_this_process_tree(tmp_path, monkeypatch):
    root = tmp_path / "proc"
    me = 100
    monkeypatch.setattr(load, "_PROC", root)
    monkeypatch.setattr(load.os, "getpid", lambda: me)
    monkeypatch.setattr(load.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(load, "_ticks", lambda: 100.0)
    clock = iter([0.0, 4.0])
    monkeypatch.setattr(load.time, "monotonic", lambda: next(clock))
    # this process, its SSD worker (a child) and the worker's child; pid 300 is someone else's
    _proc(root, 0, {me: (1, 0), 200: (me, 0), 201: (200, 0), 300: (1, 0)})
    before = load.sample()
    _proc(root, 400 + 200 + 100 + 160, {me: (1, 400), 200: (me, 200), 201: (200, 100), 300: (1, 160)})
    found = load.between(before, load.sample())
    assert found.others_cores == pytest.approx(1.6 / 4) and found.cores == 2
    assert found.disturbed and found.describe() == "other processes used 0.4 of 2 cores"
    quiet = load.Disturbance(0.2, 2, 4.0)
    assert not quiet.disturbed  # under 15% of the machine
    assert load.Disturbance(None, 2, 0.5).short() == "unknown"


def test_the_real_meter_reads_this_machine():
    first = load.sample()
    assert first.cores >= 1 and first.ours > 0
    short = load.between(first, load.sample())
    assert short.others_cores is None  # under a second: the ticks say nothing


def test_timing_and_identity_lines():
    row = RaceRow("AR", 10, 1.0, 0.1, 10.0, 1.0, None, 1.0, None, None)
    calm, rerun = replace(row, mode="SD"), replace(row, mode="SSD", dropped=("other processes used 1.2 of 2 cores",))
    assert timing_note([row, calm]) == "timings: no other load on the CPU during any mode"
    assert "SSD ran again: its first run shared the CPU (other processes used 1.2 of 2 cores)" in timing_note([rerun])
    bad = replace(rerun, disturbed="other processes used 1.1 of 2 cores")
    assert "SSD* ran while other processes used 1.1 of 2 cores (on its re-run too)" in timing_note([bad])
    assert "not this hardware's own" in timing_note([bad])
    assert identical_verdict([row, replace(calm, identical=True)], True) == "same: identical output in every mode ✓"
    text = identical_verdict([row, replace(calm, identical=False, first_diff=7)], False)
    assert "expected at T>0" in text and "SD from token 7" in text


def test_a_disturbed_mode_is_recorded_again_once():
    engine = FakeEngine()
    ids = engine.encode("hi", chat=True)
    params = SamplingParams(max_new_tokens=10)
    meter = FakeMeter(others=(1.5, 0.0, 1.5, 1.5))
    told = []
    specs = race_specs(engine.config.spec)
    calm = record_mode(engine, ids, params, specs[0], meter=meter, on_rerun=told.append)
    assert [c[2].mode for c in engine.calls] == [Mode.AR, Mode.AR] and calm.load.others_cores == 0.0
    assert len(calm.dropped) == 1 and told == list(calm.dropped)
    still = record_mode(engine, ids, params, specs[1], meter=meter)
    assert still.load.disturbed and len(still.dropped) == 1  # one re-run, then it is said
    rows = summarize([calm, still])
    assert rows[1].disturbed == "other processes used 1.5 of 2 cores" and rows[0].disturbed is None


def test_sd_choosing_per_round_projects_from_the_draft_models_measured_cost():
    """SD that chooses K per round also proposes from the suffix index (free): its draft
    time per token says nothing of the model's; the engine's measured cost does."""
    from ssdlocal.core.metrics import AdaptiveMetrics
    from ssdlocal.speculation.adaptive import CostModel

    engine = FakeEngine()
    ids = engine.encode("hi", chat=True)
    runs = [
        record_mode(engine, ids, SamplingParams(max_new_tokens=40), s, clock=engine.clock)
        for s in race_specs(engine.config.spec)
    ]
    ar, sd, ssd = (r.stats for r in runs)
    sd = replace(sd, adaptive=AdaptiveMetrics({4: sd.rounds}, 4.0, {"suffix": 5, "model": 3}))
    assert facts.projected_ssd(ar, sd, ssd, 4) is None  # the model's speed alone unknown
    costs = CostModel()
    costs.seed(0.04, 0.05, 5, 0.008)  # a draft token costs 8 ms
    _speedup, ratio = facts.projected_ssd(ar, sd, ssd, 4, costs)
    assert ratio == pytest.approx(8.0 / ar.verify_ms_per_round)
