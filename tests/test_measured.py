"""core/measured.py and its users: the start-up calibration (engine/auto.py) and the
prefill path's timings (backends/torch/prefill_path.py) are measured once per machine,
model files, backend, dtype/quantization and threads, and kept in the cache:

- a second engine on the same pair times no forwards and makes the same choice;
- a changed model file, or a changed machine (CPU flags, threads, torch), measures again;
- a damaged, edited or implausible entry is ignored, measured again and overwritten;
- `ssdlocal cache` lists the entries and removes them; `ssdlocal devices` says what it keeps.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support.cli import run_cli

from ssdlocal.core import measured
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
from ssdlocal.core.measured import MeasuredStore, positive_seconds
from ssdlocal.engine import Engine, auto
from support.drafts import draft_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(autouse=True)
def keeping(monkeypatch):
    """This module tests the kept measurements, which the rest of the suite turns off."""
    monkeypatch.setenv("SSDLOCAL_KEEP_MEASUREMENTS", "1")


def test_measurements_can_be_turned_off(tmp_path, monkeypatch):
    store = MeasuredStore(tmp_path)
    store.put("pair", {"i": 1}, [0.1])
    assert store.get("pair", {"i": 1}, positive_seconds) == [0.1]
    monkeypatch.setenv("SSDLOCAL_KEEP_MEASUREMENTS", "0")
    assert store.get("pair", {"i": 1}, positive_seconds) is None
    store.put("pair", {"i": 2}, [0.2])
    assert len(list(tmp_path.glob("*.json"))) == 1


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / measured.FOLDER


@pytest.fixture
def pair(tiny_dir, tmp_path):
    """A private copy of the tiny pair (its files' times are this test's to change)."""
    target = shutil.copytree(tiny_dir["llama"], tmp_path / "target")
    draft = shutil.copytree(tiny_dir["draft_llama"], tmp_path / "draft")
    return target, draft


@pytest.fixture
def timed(monkeypatch):
    """Counts the forwards the calibration times."""
    calls = []
    original = auto._time_steps

    def counting(runner, width, *args, **kwargs):
        calls.append(width)
        return original(runner, width, *args, **kwargs)

    monkeypatch.setattr(auto, "_time_steps", counting)
    return calls


def _start(pair, k=None):
    """An engine whose target and draft share the CPU (the case that calibrates); K pinned
    (`k`) calibrates the pair, K per round times each step width too."""
    target, draft = pair
    spec = SpecConfig(
        mode=Mode.AUTO, draft=draft_of(str(draft)), **({"k": k, "adaptive_k": False} if k else {"adaptive_k": True})
    )
    with Engine(EngineConfig(ModelSpec(str(target), dtype="float32"), spec, pin_cpus=False)) as engine:
        return engine.choice


def test_a_second_start_reads_the_calibration_and_chooses_alike(cache, pair, timed):
    first = _start(pair)
    assert len(timed) == 3 + len(auto.WIDTHS)  # target at 1 and K+1, draft at 1; then each width
    kinds = sorted(p.name.split("-")[0] for p in cache.glob("*.json"))
    assert kinds == ["pair", "widths"]
    timed.clear()
    second = _start(pair)
    assert timed == [] and second.widths == first.widths and second.mode is first.mode
    assert "measured at load" in first.reason and "measured at an earlier start (kept in the cache)" in second.reason
    assert second.reason.split(": target")[1] == first.reason.split(": target")[1]  # the same figures
    timed.clear()
    _start(pair, k=2)  # another K is another calibration of the pair
    assert timed == [1, 3, 1]


def test_a_changed_model_file_measures_again(cache, pair, timed):
    _start(pair, k=2)
    weights = next(pair[1].glob("*.safetensors"))  # the draft's
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    timed.clear()
    _start(pair, k=2)
    assert timed == [1, 3, 1] and len(list(cache.glob("pair-*.json"))) == 2


@pytest.mark.parametrize("change", ["threads", "flags", "torch"])
def test_a_changed_machine_measures_again(cache, pair, timed, monkeypatch, change):
    _start(pair, k=2)
    here = measured.machine()
    other = {**here, change: "something else"}
    monkeypatch.setattr(measured, "machine", lambda: other)
    timed.clear()
    _start(pair, k=2)
    assert timed == [1, 3, 1]


def test_a_rebuilt_llama_cpp_is_another_key(tmp_path, monkeypatch):
    """Timings of a llama.cpp model are kept per library build: an upgrade, or a rebuild
    with other CPU flags under the same version (its native files change), runs other
    kernels, so its kept timings are not trusted. A torch model's key has no such entry
    (torch's version is in the machine's key)."""
    from ssdlocal.backends.llamacpp import probe

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    spec = ModelSpec(str(gguf), backend="llamacpp")
    build = {"version": "0.3.36", "path": "/x", "files": [["lib/libggml-cpu.so", 100, 1]]}
    monkeypatch.setattr(probe, "library_identity", lambda: build)
    first = auto.model_key(spec)
    assert build in first and auto.model_key(spec) == first
    build = {**build, "files": [["lib/libggml-cpu.so", 120, 2]]}  # rebuilt with other flags
    assert auto.model_key(spec) != first
    torch_key = auto.model_key(ModelSpec(str(gguf), backend="torch"))
    assert not any(isinstance(part, dict) for part in torch_key)


@pytest.mark.parametrize("damage", ["garbage", "negative", "nan", "count", "key", "huge", "directory"])
def test_a_damaged_or_edited_entry_is_never_trusted(cache, pair, timed, damage):
    _start(pair, k=2)
    (path,) = cache.glob("pair-*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    elif damage == "huge":
        path.write_text(json.dumps({**data, "pad": "x" * (measured.MAX_BYTES + 1)}))
    else:
        value = {
            "negative": [-1.0, 0.1, 0.1],
            "nan": [float("nan"), 0.1, 0.1],
            "count": [0.1, 0.1],
            "key": data["value"],
        }[damage]
        key = {**data["key"], "k": 7} if damage == "key" else data["key"]
        path.write_text(json.dumps({**data, "key": key, "value": value}))
    timed.clear()
    _start(pair, k=2)
    assert timed == [1, 3, 1]
    if damage != "directory":  # measured again and kept: the next start trusts the new entry
        assert positive_seconds(json.loads(path.read_text())["value"], 3)
        timed.clear()
        _start(pair, k=2)
        assert timed == []


def test_the_store_keeps_at_most_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "MAX_FILES", 3)
    store = MeasuredStore(tmp_path)
    for i in range(5):
        store.put("pair", {"i": i}, [0.1])
    assert len(list(tmp_path.glob("*.json"))) == 3
    assert store.get("pair", {"i": 4}, positive_seconds) == [0.1]
    assert store.get("pair", {"i": 0}, positive_seconds) is None


def test_prefill_path_timings_are_kept_across_processes(cache, tiny_dir, monkeypatch):
    import torch

    from ssdlocal.backends.torch import prefill_path

    spec = ModelSpec(str(tiny_dir["llama"]), dtype="bfloat16", quantization="int4")
    with Engine(EngineConfig(target=spec, prefix_cache_tokens=0)) as engine:
        prefill_path._MEASURED.clear()
        first = prefill_path.dense_dtype(engine.runner.model, 512)
        (costs,) = prefill_path._MEASURED.values()
        assert len(list(cache.glob("prefill-path-*.json"))) == 1
        prefill_path._MEASURED.clear()  # as in a new process
        monkeypatch.setattr(prefill_path, "_measure", lambda linear: pytest.fail("measured again"))
        assert prefill_path.dense_dtype(engine.runner.model, 512) == first
        (again,) = prefill_path._MEASURED.values()
        assert again == costs and set(again.dense) == {torch.bfloat16, torch.float32}
        prefill_path._MEASURED.clear()


def test_cache_and_devices_show_the_kept_timings(cache, pair, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "devices")
    assert code == 0, err
    assert "calibration: none kept for this machine yet" in out
    _start(pair, k=2)
    code, out, err = run_cli(monkeypatch, capsys, "devices")
    assert code == 0, err
    assert "calibration: 1 timing(s) kept for this machine" in out and "models: target, draft" in out
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--json")
    assert json.loads(out)["calibration"][0]["kind"] == "pair"
    code, out, err = run_cli(monkeypatch, capsys, "cache")
    assert code == 0 and "calibration (" in out and "timings of this machine" in out, out
    code, out, err = run_cli(monkeypatch, capsys, "cache", "remove", "calibration")
    assert code == 0, err
    assert not list(cache.glob("*.json"))
