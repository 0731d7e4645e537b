"""Automatic choices, explained: `--mode auto` (placement rules and the CPU calibration),
`--target-device/--draft-device auto` (planner inputs faked), `--target-backend auto`,
and the `mode` / `mode_reason` the engine reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.cli import run_cli

from ssdlocal.cli.resolve import ModelOptions, SpecOptions, choose_backends, engine_config
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from ssdlocal.engine.auto import Calibration, calibrated_choice, placement_choice
from support.devices import machine
from support.drafts import draft_of
from ssdlocal.core.config import ModelDraft


def _config(target="cuda:0", draft="cuda:1", draft_path="d", tp=()) -> EngineConfig:
    spec = SpecConfig(mode=Mode.AUTO, k=4, draft=draft_of(draft_path, draft))
    return EngineConfig(ModelSpec("t", target, dtype="float32"), spec, target_devices=tp)


@pytest.mark.parametrize(
    ("config", "mode", "words"),
    [
        (_config(draft_path=None), Mode.AR, "no draft"),
        (_config(draft_path="ngram"), Mode.SD, "n-gram"),
        (_config("cuda:0", "cuda:1"), Mode.SSD, "hardware of its own (cuda:1"),
        (_config("cuda:0", "cpu"), Mode.SSD, "hardware of its own (cpu"),
        (_config("cuda:0", "cuda:2", tp=("cuda:0", "cuda:1")), Mode.SSD, "target on cuda:0,cuda:1"),
        (_config("cuda:0", "cuda:0"), Mode.SD, "share cuda:0"),
        (_config("cuda:0", "cuda:0", tp=("cuda:0", "cuda:1")), Mode.SD, "share cuda:0"),
        (_config("cuda", "cuda:0"), Mode.SD, "share cuda:0"),  # one GPU, two spellings
        (_config("cuda:0", "cuda"), Mode.SD, "share cuda:0"),
    ],
)
def test_placement_decides_the_mode(config, mode, words):
    choice = placement_choice(config)
    assert choice.mode is mode and words in choice.reason, choice


@pytest.mark.parametrize("tp", [(), ("cuda:0", "cuda:1")])
def test_one_gpu_for_target_and_draft_is_sd_and_the_reason_says_why(tp):
    """SSD's worker would be a second process on the target's GPU: its kernels time-slice
    with the target's (no MPS) and it waits after every tree step, so nothing overlaps."""
    choice = placement_choice(_config("cuda:0", "cuda:0", tp=tp))
    assert choice.mode is Mode.SD
    for words in ("second process", "time-slice", "no MPS", "after every tree step", "not overlap verification"):
        assert words in choice.reason, words
    assert choice.line == "mode sd: target and draft share cuda:0: SSD's worker would time-slice"


def test_device_names_are_normalised():
    from ssdlocal.core.config import normalize_device

    assert [normalize_device(d) for d in ("cuda", "cuda:0", "cuda:01", "cuda:3", "cpu")] == [
        "cuda:0",
        "cuda:0",
        "cuda:1",
        "cuda:3",
        "cpu",
    ]
    assert ModelSpec("t", "cuda", dtype="float32").device == "cuda:0"
    assert EngineConfig(ModelSpec("t", "cuda", dtype="float32"), target_devices=("cuda", "cuda:1")).target_devices == (
        "cuda:0",
        "cuda:1",
    )


def test_cpu_only_needs_a_calibration():
    assert placement_choice(_config("cpu", "cpu")) is None


def test_calibration_picks_the_faster_mode_and_says_why():
    # llama.cpp-like quantized CPU kernels: a 5-token verify costs 5x one token
    slow_verify = calibrated_choice(Calibration(4, 0.040, 0.210, 0.015))
    assert slow_verify.mode is Mode.AR
    assert "40 ms/token" in slow_verify.reason and "210 ms per 5-token verify" in slow_verify.reason
    # memory-bound bf16: a 5-token verify costs 1.2x one token, the draft a third of it
    cheap_verify = calibrated_choice(Calibration(4, 0.150, 0.180, 0.050))
    assert cheap_verify.mode is Mode.SD and "predicted AR 6.7 vs SD 7.3" in cheap_verify.reason
    ar, sd = Calibration(1, 1.0, 1.0, 0.0).predicted(acceptance=0.5)
    assert ar == 1.0 and sd == pytest.approx(1.5)  # E = 1 + 0.5 tokens per 1 s round


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_engine_auto_on_cpu_reports_mode_and_reason(tiny_dir, one_thread):
    t, d = str(tiny_dir["llama"]), str(tiny_dir["draft_llama"])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = EngineConfig(
        ModelSpec(t, dtype="float32"), SpecConfig(mode=Mode.AUTO, k=3, draft=ModelDraft(ModelSpec(d, dtype="float32")))
    )
    with Engine(config) as engine:
        assert engine.choice.mode in (Mode.AR, Mode.SD) and "share the CPU" in engine.choice.reason
        done = [e for e in engine.generate(["the cat"], params) if isinstance(e, DoneEvent)][0]
        assert done.stats["mode"] == engine.choice.mode.value
        assert done.stats["mode_reason"] == engine.choice.reason
        ar = [
            e for e in engine.generate(["the cat"], params, spec=SpecConfig(mode=Mode.AR)) if isinstance(e, DoneEvent)
        ][0]
        assert ar.stats["mode"] == "ar" and "asked for" in ar.stats["mode_reason"]
        assert ar.outputs[0].token_ids == done.outputs[0].token_ids


def test_generate_prints_the_mode_and_json_carries_it(tiny_dir, monkeypatch, capsys, one_thread):
    args = [
        "generate",
        "def foo(x):",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
    ]
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "mode ar: " in err or "mode sd: " in err, err
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--json")
    payload = json.loads(out)
    assert payload["mode"] in ("ar", "sd") and payload["mode"] == payload["stats"]["mode"]
    assert "share the CPU" in payload["stats"]["mode_reason"]


# --------------------------------------------------------------------------- devices
@pytest.mark.parametrize(
    ("gpus", "target", "draft"),
    [((), "cpu", "cpu"), ((80.0,), "cuda:0", "cuda:0"), ((80.0, 80.0), "cuda:0", "cuda:1")],
)
def test_auto_devices_follow_the_planner(tiny_dir, monkeypatch, gpus, target, draft):
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(*gpus))
    models = ModelOptions(
        target=str(tiny_dir["llama"]), draft=str(tiny_dir["draft_llama"]), target_backend="torch", draft_backend="torch"
    )
    config = engine_config(models, SpecOptions())
    assert (config.target.device, config.draft_model.device) == (target, draft)
    assert config.spec.mode is Mode.AUTO


def test_explicit_target_device_gets_an_auto_draft_device(tiny_dir, monkeypatch):
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(24.0, 24.0, 24.0))
    models = ModelOptions(
        target=str(tiny_dir["llama"]),
        draft=str(tiny_dir["draft_llama"]),
        target_device="cuda:2",
        target_backend="torch",
        draft_backend="torch",
    )
    assert engine_config(models, SpecOptions()).draft_model.device == "cuda:0"


# --------------------------------------------------------------------------- backends
def _healthy_llamacpp(monkeypatch, extra_bufts=True):
    """llama-cpp-python 'installed' and its probe passed (probe.py is tested on its own)."""
    from ssdlocal.backends.llamacpp import probe

    verdict = probe.Verdict(True, extra_bufts, "passed", "llama-cpp-python 0.0", Path("v.json"))
    monkeypatch.setattr(probe, "installed", lambda: True)
    monkeypatch.setattr(probe, "llamacpp_verdict", lambda *a, **k: verdict)


def test_auto_backend_prefers_llamacpp_for_gguf_on_cpu(monkeypatch, tmp_path):
    gguf = str(tmp_path / "m.gguf")
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine())
    _healthy_llamacpp(monkeypatch)
    assert choose_backends(ModelOptions(target=gguf, draft=gguf)) == ("llamacpp", "llamacpp")
    assert choose_backends(ModelOptions()) == ("llamacpp", "llamacpp")  # the built-in GGUF pair
    assert choose_backends(ModelOptions(target=str(tmp_path))) == ("torch", "torch")  # HF dir
    assert choose_backends(ModelOptions(target=gguf, draft=str(tmp_path))) == ("llamacpp", "torch")
    assert choose_backends(ModelOptions(target=gguf, target_device="cuda:0"))[0] == "torch"
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(24.0))
    assert choose_backends(ModelOptions(target=gguf))[0] == "torch"  # a GPU is in play


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_steers_auto_to_torch(monkeypatch, tmp_path, capsys, quantization):
    """--quantization int8/int4 with backend auto picks torch, the backend that applies it
    (and says so); with an explicit llama.cpp it stays an error with a hint."""
    from ssdlocal.cli.resolve import backend_choice
    from ssdlocal.core.errors import UsageError

    gguf = str(tmp_path / "m.gguf")
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine())
    _healthy_llamacpp(monkeypatch)
    choice = backend_choice(ModelOptions(target=gguf, draft=gguf, quantization=quantization))
    assert (choice.target, choice.draft) == ("torch", "torch")
    assert f"--quantization {quantization}" in choice.note and "torch" in choice.note
    default = backend_choice(ModelOptions(quantization=quantization))  # the default pair
    assert (default.target, default.draft) == ("torch", "torch")
    # only the draft's quantization asks for torch: the target stays on llama.cpp
    split = backend_choice(ModelOptions(target=gguf, draft=gguf, draft_quantization=quantization))
    assert (split.target, split.draft) == ("llamacpp", "torch")
    with pytest.raises(UsageError, match="torch backend only") as info:
        engine_config(
            ModelOptions(target=gguf, target_backend="llamacpp", quantization=quantization), SpecOptions(mode="ar")
        )
    assert "torch" in info.value.hint


def test_auto_backend_notes_llamacpp_without_repacking(monkeypatch, tmp_path):
    from ssdlocal.cli.resolve import backend_choice

    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine())
    _healthy_llamacpp(monkeypatch, extra_bufts=False)
    choice = backend_choice(ModelOptions(target=str(tmp_path / "m.gguf")))
    assert (choice.target, choice.note) == ("llamacpp", "passed")


def test_auto_backend_without_llamacpp_is_torch(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    assert choose_backends(ModelOptions(target=str(tmp_path / "m.gguf"))) == ("torch", "torch")
