"""One account of what runs where: the placement's mode decision and its words are the
same in `devices` and the engine; a CPU calibration's SD re-checks itself against plain
steps at the load its rounds measured and switches (saying so) when SD is slower; the
switch keeps the output exact."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
from support.cli import run_cli

from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, ModeEvent
from ssdlocal.engine import Engine
from ssdlocal.engine.auto import Calibration, ModeCheck, calibrated_choice
from ssdlocal.placement.mode import placement_mode

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

WIDTHS = {1: 0.100, 2: 0.100, 5: 0.200, 13: 0.400}  # calibrated seconds per target step


def test_sd_that_beats_plain_steps_is_kept():
    check = ModeCheck(WIDTHS, rounds=4)
    # 5 tokens wide, 3 tokens per round in 0.25 s (12 tok/s) at the calibrated load (plain: 10)
    assert all(check.observe(1, 3, 0.05, 0.200, 5) is None for _ in range(10))


def test_sd_slower_than_plain_steps_at_the_same_load_gives_way():
    check = ModeCheck(WIDTHS, rounds=4)
    # the machine got 3x busier than at calibration (verify 0.6 s where 0.2 was measured):
    # plain steps would make 1 / 0.3 = 3.3 tok/s; these rounds make 1.2 / 0.9 = 1.3
    results = [check.observe(1, 1.2, 0.3, 0.600, 5) for _ in range(4)]
    assert results[:3] == [None, None, None]
    change = results[3]
    assert change.mode is Mode.AR
    assert "switched from SD after 4 rounds" in change.reason and "3.0x the calibration" in change.reason
    assert "1.3 tok/s" in change.short and "3.3" in change.short
    assert check.observe(1, 1.2, 0.3, 0.600, 5) is None  # said once


def test_a_stalled_round_does_not_decide():
    check = ModeCheck(WIDTHS, rounds=5)
    rounds = [(3, 0.05, 0.2)] * 4 + [(3, 0.05, 20.0)]  # one round stalled by another process
    assert all(check.observe(1, n, d, v, 5) is None for n, d, v in rounds)


def test_costly_probes_that_make_sd_slower_overall_count():
    """Mostly plain steps (0.1 s, 1 token) with a probe every 4th round whose draft catch-up
    costs 1 s: 7 tokens in 1.6 s (4.4 tok/s) where plain steps make 10 tok/s."""
    check = ModeCheck(WIDTHS, rounds=8)
    rounds = [(1, 0.0, 0.1, 1), (1, 0.0, 0.1, 1), (1, 0.0, 0.1, 1), (4, 1.0, 0.2, 5)] * 2
    changes = [check.observe(1, n, d, v, w) for n, d, v, w in rounds]
    assert changes[-1] is not None and changes[-1].mode is Mode.AR, changes


def test_sd_a_few_percent_slower_than_plain_steps_gives_way():
    """Plain rounds (1 token) at 0.108 s where a plain step costs 0.100 at the same load:
    8% slower, within the old 15% margin, past CHECK_MARGIN."""
    check = ModeCheck(WIDTHS, rounds=4)
    changes = [check.observe(1, 1, 0.0, 0.100, 1, wall_s=0.108) for _ in range(4)]
    assert changes[-1] is not None and changes[-1].mode is Mode.AR, changes


def test_the_rounds_whole_time_counts_not_only_draft_and_verify():
    """Draft and verify times alone say SD ties with plain steps; the rounds' upkeep around
    them (choosing K, the draft's cache, committing) makes them slower, and counts."""
    timed_only = ModeCheck(WIDTHS, rounds=4)
    assert all(timed_only.observe(1, 1, 0.0, 0.100, 1) is None for _ in range(8))
    whole = ModeCheck(WIDTHS, rounds=4)
    assert [whole.observe(1, 1, 0.0, 0.100, 1, wall_s=0.120) for _ in range(4)][-1] is not None
    kept = ModeCheck(WIDTHS, rounds=4)  # a wall time below draft + verify is a clock's noise
    assert all(kept.observe(1, 3, 0.05, 0.200, 5, wall_s=0.01) is None for _ in range(8))


def test_a_round_is_timed_without_its_consumer():
    """_Rechecked times the round's own code: a consumer that sleeps between events (a
    terminal printing tokens) adds nothing to what the check sees."""
    import time

    from ssdlocal.core.events import RoundEvent
    from ssdlocal.engine.auto import _Rechecked

    class Rounds:
        def run(self, index):
            time.sleep(0.05)
            yield RoundEvent(index, (0,), (0,), rows=(0,), n_emitted=(1,), verify_s=0.04)

    seen = []

    class Check:
        def round(self, event, wall_s=None):
            seen.append(wall_s)

    rechecked = _Rechecked(Rounds(), Check())
    for index in range(3):
        for _ in rechecked.run(index):
            time.sleep(0.2)  # the consumer
    assert len(seen) == 3 and all(0.05 <= s < 0.15 for s in seen), seen


def test_the_first_model_round_reads_the_prompt_and_is_left_out():
    check = ModeCheck(WIDTHS, rounds=4)
    assert check.observe(1, 3, 30.0, 0.2, 5, model_drafted=True) is None  # the draft's prefill
    assert all(check.observe(1, 3, 0.05, 0.2, 5, model_drafted=True) is None for _ in range(8))


def test_devices_and_the_engine_give_the_same_reason():
    """The short line `devices` prints for a CPU-only machine is the one the engine prints
    after its calibration (plus the measurements, in the full reason only)."""
    planned = placement_mode(("cpu",), "cpu", "model", "", adaptive_k=True)
    engine = calibrated_choice(Calibration(12, 0.08, 0.4, 0.05), adaptive_k=True)
    assert planned.line == engine.line
    assert len(engine.line) <= 80
    assert "measured at load: target 80 ms/token" in engine.reason and "80 ms" not in engine.line


def test_devices_prints_the_engines_mode_line(monkeypatch, capsys):
    from ssdlocal.placement.inventory import DeviceInventory

    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: DeviceInventory((), 2, 16.0))
    code, out, err = run_cli(monkeypatch, capsys, "devices")
    assert code == 0, err
    assert placement_mode(("cpu",), "cpu", "model").line in out
    assert "separate processes on separate cores" not in out  # the old SSD-sounding note
    assert "int4" in out  # the weights' format, not only a dtype


def test_kernels_that_part_with_the_call_width_run_ar_and_devices_says_so(monkeypatch, capsys):
    """llama.cpp's CPU kernels give a token other logits in a call of several tokens than
    alone: `auto` runs AR there whatever the draft, and `devices --backend llamacpp` prints
    the line the engine prints (the torch default plans SD)."""
    from ssdlocal.placement.inventory import DeviceInventory

    for kind in ("model", "ngram", "suffix"):
        choice = placement_mode(("cpu",), "cpu", kind, batch_exact=False)
        assert choice.mode is Mode.AR and "--batch-invariant" in choice.reason and len(choice.line) <= 80
    assert placement_mode(("cpu",), None, "none", batch_exact=False).line == placement_mode(("cpu",), None, "none").line
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: DeviceInventory((), 2, 16.0))
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--backend", "llamacpp")
    assert code == 0, err
    assert placement_mode(("cpu",), "cpu", "model", batch_exact=False).line in out


def test_devices_on_one_gpu_shares_it_like_the_engine(monkeypatch, capsys):
    """One GPU: the draft shares it (what `--draft-device auto` does), the mode is SD."""
    from ssdlocal.placement.inventory import GPU, DeviceInventory

    monkeypatch.setattr(
        "ssdlocal.placement.inventory.detect", lambda: DeviceInventory((GPU(0, "GPU", 80.0, 80.0),), 16, 64.0)
    )
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["plan"]["draft_device"] == "cuda:0" and payload["mode"]["mode"] == "sd"
    assert "share cuda:0" in payload["mode"]["reason"]


def _engine(tiny_dir, monkeypatch, k=3):
    """An auto engine on the CPU with K pinned whose calibration picked SD (forced: tiny
    float32 models make plain steps the faster choice here)."""
    from ssdlocal.engine import auto
    from ssdlocal.placement.mode import ModeChoice

    monkeypatch.setattr(
        auto, "calibrated_choice", lambda cal, adaptive: ModeChoice(Mode.SD, "calibrated: SD", "calibrated")
    )
    t, d = str(tiny_dir["llama"]), str(tiny_dir["draft_llama"])
    spec = SpecConfig(mode=Mode.AUTO, k=k, adaptive_k=False, draft=ModelDraft(ModelSpec(d, dtype="float32")))
    return Engine(EngineConfig(ModelSpec(t, dtype="float32"), spec, pin_cpus=False))


def test_an_engine_switches_to_plain_steps_mid_answer_and_stays_exact(tiny_dir, monkeypatch):
    """Widths calibrated as if a 1-token step were nearly free: after the check's rounds
    SD gives way; the answer equals AR's token for token and the ModeEvent says why."""
    from ssdlocal.engine import auto

    monkeypatch.setattr(auto, "ModeCheck", functools.partial(ModeCheck, rounds=3))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    with _engine(tiny_dir, monkeypatch) as engine:
        assert engine.choice.mode is Mode.SD
        engine.choice = replace(engine.choice, widths={1: 1e-6, 4: 1.0})  # plain steps a million times cheaper
        events = list(engine.generate(["the cat sat"], params))
        changes = [e for e in events if isinstance(e, ModeEvent)]
        assert len(changes) == 1 and changes[0].mode == "ar" and changes[0].round_index == 3  # round 0 skipped
        assert "switched from SD" in changes[0].reason
        got = [e for e in events if isinstance(e, DoneEvent)][0].outputs[0].token_ids
        ar = (
            [
                e
                for e in engine.generate(["the cat sat"], params, spec=SpecConfig(mode=Mode.AR))
                if isinstance(e, DoneEvent)
            ][0]
            .outputs[0]
            .token_ids
        )
        assert engine.choice.mode is Mode.SD  # the next call starts in SD again, and re-checks
        again = list(engine.generate(["the cat sat"], params))
        assert [e.round_index for e in again if isinstance(e, ModeEvent)] == [3]
    assert got == ar and len(got) == 40


def test_a_pinned_k_sample_never_switches(tiny_dir, monkeypatch):
    """At T > 0 with K pinned a seeded sample must repeat, so timing may not change the mode."""
    with _engine(tiny_dir, monkeypatch) as engine:
        engine.choice = replace(engine.choice, widths={1: 1e-6, 4: 1.0})
        params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30, ignore_eos=True)
        events = list(engine.generate(["the cat sat"], params))
    assert not [e for e in events if isinstance(e, ModeEvent)]


def test_generate_json_reports_a_change_of_mind(tiny_dir, monkeypatch, capsys):
    from ssdlocal.engine import auto
    from ssdlocal.placement.mode import ModeChoice

    original = auto.calibrated

    def calibrated(*args):
        choice = original(*args)
        return replace(choice, widths={1: 1e-6, 4: 1.0}) if choice.widths else choice

    monkeypatch.setattr("ssdlocal.engine.engine.calibrated", calibrated)
    monkeypatch.setattr(auto, "ModeCheck", functools.partial(ModeCheck, rounds=2))
    monkeypatch.setattr(
        auto, "calibrated_choice", lambda cal, adaptive: ModeChoice(Mode.SD, "calibrated: SD", "calibrated")
    )
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "the cat sat",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--k",
        "3",
        "--max-new-tokens",
        "30",
        "--ignore-eos",
        "--json",
    )
    assert code == 0, err
    payload = json.loads(out)
    assert payload["mode_changes"][0]["mode"] == "ar", payload.get("mode_changes")
    assert "mode ar after round 3: switched from SD" in err
