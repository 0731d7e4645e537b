"""llama.cpp is probed in a child process before it is trusted (backends/llamacpp/probe.py).

A fake llama-cpp-python (tests/support/fake_llama_cpp) stands in for the native library: one that
works, one whose first evaluation dies of SIGSEGV or SIGABRT, one that crashes or hangs
only with CPU weight repacking on. Checked: the verdicts and their one-line reasons, the
retry with repacking off (and that LlamaLib then loads models with it off), the cache
(keyed by library build and CPU flags, reused, not trusted when damaged), `auto` routing
to torch, and an explicit llama.cpp that crashed becoming `error:` + `hint:` on the CLI.
The probe's own tiny model is checked against the `gguf` reader here and run through the
real llama.cpp in test_llamacpp_real.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from support.cli import assert_clean_error, run_cli
from ssdlocal.backends.llamacpp import probe
from ssdlocal.cli.resolve import ModelOptions, backend_choice
from ssdlocal.core.errors import ModelLoadError

FAKE = Path(__file__).resolve().parent / "support" / "fake_llama_cpp"


@pytest.fixture
def fake_lib(monkeypatch, tmp_path):
    """Install the fake llama_cpp for this test; returns set_mode(mode) -> loads logged."""
    log = tmp_path / "loads.log"
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_LLAMA_CPP_LOG", str(log))
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)

    def loads() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    def set_mode(mode: str):
        monkeypatch.setenv("FAKE_LLAMA_CPP", mode)
        return loads

    yield set_mode
    sys.modules.pop("llama_cpp", None)  # the fake, if a test imported it


def test_probe_model_is_a_valid_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from ssdlocal.backends.llamacpp.probe_model import VOCAB, write_probe_gguf

    reader = gguf.GGUFReader(str(write_probe_gguf(tmp_path / "probe.gguf")))
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q4_0", "Q8_0", "Q6_K", "F32"} <= types  # the types llama.cpp repacks
    for t in reader.tensors:
        assert np.isfinite(dequantize(t.data, t.tensor_type)).all(), t.name
    field = reader.fields["tokenizer.ggml.tokens"]
    assert len(field.data) == VOCAB
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"


def test_working_library_is_trusted_and_cached(fake_lib):
    loads = fake_lib("ok")
    first = probe.llamacpp_verdict()
    assert first.ok and first.extra_bufts and first.fresh
    assert "evaluated a tiny model" in first.reason and loads() == ["load extra_bufts=True"]
    again = probe.require_llamacpp()
    assert again.ok and not again.fresh and len(loads()) == 1  # from the cache: no child
    saved = json.loads(first.path.read_text())
    assert saved["key"] == probe.probe_key(probe.library_identity()) and saved["ok"] is True


@pytest.mark.parametrize(("mode", "signal_name"), [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_crashing_library_is_refused_with_a_hint(fake_lib, mode, signal_name):
    loads = fake_lib(mode)
    found = probe.llamacpp_verdict()
    assert not found.ok and found.fresh
    assert signal_name in found.reason and "repacking off" in found.reason
    assert loads() == ["load extra_bufts=True", "load extra_bufts=False"]  # tried both
    assert "\n" not in found.reason  # one line
    with pytest.raises(ModelLoadError) as info:
        probe.require_llamacpp()
    assert "torch" in info.value.hint and str(found.path) in info.value.hint
    assert len(loads()) == 2  # the verdict came from the cache


def test_old_library_without_the_switch(fake_lib):
    loads = fake_lib("no-switch")
    found = probe.llamacpp_verdict()
    assert not found.ok and "SIGSEGV" in found.reason and "repacking off" not in found.reason
    assert len(loads()) == 1  # nothing to retry with


def test_repacking_crash_runs_with_repacking_off(fake_lib, monkeypatch):
    """Where only the CPU weight repacking crashes, llama.cpp is used with it off: the
    runner's LlamaLib loads every model with use_extra_bufts = False, and says why."""
    from ssdlocal.backends.llamacpp import lib as lib_module

    loads = fake_lib("repack-segv")
    found = probe.llamacpp_verdict()
    assert found.ok and not found.extra_bufts
    assert "SIGSEGV" in found.reason and "runs with it off" in found.reason
    monkeypatch.setattr(lib_module, "_BACKEND_READY", False)
    lib = lib_module.LlamaLib()  # the fake llama_cpp, in this process
    assert lib.extra_bufts is False
    lib.load_model("unused.gguf", 0, 0)
    assert loads()[-1] == "load extra_bufts=False"
    llm = lib_module.high_level_llama(model_path="m.gguf")  # the benchmark's peers
    assert llm.extra_bufts is False and llm.kwargs == {"model_path": "m.gguf"}
    assert lib.ll.llama_model_default_params().use_extra_bufts is True  # restored


def test_a_quiet_peer_leaves_llama_cpp_quiet(fake_lib):
    """`Llama(verbose=False)` sets llama-cpp-python's logger to ERROR, which printed
    llama.cpp's error-level notices of our later contexts under bench's table; after a
    peer made by high_level_llama the logger is as quiet as LlamaLib left it."""
    import logging

    from ssdlocal.backends.llamacpp import lib as lib_module

    fake_lib("ok")
    logger = logging.getLogger("llama-cpp-python")
    lib_module.LlamaLib()
    assert logger.level > logging.CRITICAL
    lib_module.high_level_llama(model_path="m.gguf", verbose=False)
    assert logger.level > logging.CRITICAL
    lib_module.high_level_llama(model_path="m.gguf")  # Llama's default: verbose
    assert logger.level == logging.DEBUG
    lib_module.quiet_logs(False)


def test_hanging_library_times_out(fake_lib):
    """A child that never answers is killed at the timeout; the retry with repacking off
    (which does not hang) decides."""
    loads = fake_lib("repack-hang")
    found = probe.llamacpp_verdict(timeout_s=10)
    assert found.ok and not found.extra_bufts, found.reason
    assert "no answer within 10 s" in found.reason
    assert loads()[-1] == "load extra_bufts=False"


def test_damaged_or_foreign_cache_is_not_trusted(fake_lib, monkeypatch):
    loads = fake_lib("ok")
    found = probe.llamacpp_verdict()
    path, key = found.path, json.loads(found.path.read_text())["key"]
    good = path.read_text()
    for damaged in (
        good[: len(good) // 2],
        "",
        json.dumps({**json.loads(good), "key": "0" * 64}),
        json.dumps({k: v for k, v in json.loads(good).items() if k != "extra_bufts"}),
        json.dumps({**json.loads(good), "ok": "yes"}),
    ):
        path.write_text(damaged)
        assert probe.read_verdict(path, key) is None
    path.write_text(good[:-20])  # half written: probed again, and rewritten whole
    assert probe.llamacpp_verdict().fresh and len(loads()) == 2
    assert probe.read_verdict(path, key) is not None
    monkeypatch.setattr(probe, "cpu_flags", lambda: "x86_64 avx2 fma")  # another CPU
    other = probe.llamacpp_verdict()
    assert other.fresh and other.path != path and len(loads()) == 3
    identity = probe.library_identity()
    assert identity["files"][0][0] == "__init__.py"  # the package's files: size and time
    rebuilt = {**identity, "files": [["__init__.py", 1, 2]]}  # same version, other build
    assert probe.probe_key(rebuilt) != probe.probe_key(identity)
    assert probe.probe_key({**identity, "version": "9.9"}) != probe.probe_key(identity)


# --------------------------------------------------------------------------- choosing
def _cpu_only(monkeypatch):
    from support.devices import machine as _machine

    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: _machine())


def test_auto_routes_around_a_crashing_llamacpp(fake_lib, monkeypatch, tmp_path):
    _cpu_only(monkeypatch)
    fake_lib("segv")
    gguf = str(tmp_path / "m.gguf")
    choice = backend_choice(ModelOptions(target=gguf))
    assert (choice.target, choice.draft) == ("torch", "torch")
    assert choice.note.startswith("backend torch: ") and "SIGSEGV" in choice.note
    default = backend_choice(ModelOptions())  # the default command's pair (GGUF)
    assert (default.target, default.draft) == ("torch", "torch") and "SIGSEGV" in default.note
    with pytest.raises(ModelLoadError, match="SIGSEGV"):
        backend_choice(ModelOptions(target=gguf, target_backend="llamacpp"))


def test_auto_keeps_llamacpp_with_repacking_off(fake_lib, monkeypatch, tmp_path):
    _cpu_only(monkeypatch)
    fake_lib("repack-segv")
    choice = backend_choice(ModelOptions(target=str(tmp_path / "m.gguf")))
    assert (choice.target, choice.draft) == ("llamacpp", "llamacpp")
    assert "repacking" in choice.note and "runs with it off" in choice.note


def test_cli_explicit_llamacpp_that_crashes_is_an_error(fake_lib, monkeypatch, capsys, tmp_path):
    """No segfault reaches the user: `error:` and `hint:`, exit 1, before any load."""
    fake_lib("segv")
    target = tmp_path / "m.gguf"
    target.write_bytes(b"GGUF" + b"\0" * 60)
    code, _, err = run_cli(
        monkeypatch, capsys, "generate", "hi", "--target", str(target), "--mode", "ar", "--target-backend", "llamacpp"
    )
    assert_clean_error(code, err, 1, "SIGSEGV", "--target-backend torch")


def test_cli_auto_runs_on_torch_when_llamacpp_crashes(fake_lib, monkeypatch, capsys, tmp_path):
    """A GGUF with every choice left to `auto` on a CPU-only machine whose llama.cpp dies:
    the command runs to its end on the torch backend and says why in one line."""
    pytest.importorskip("gguf")
    from support.tiny_gguf import write_tiny_gguf

    _cpu_only(monkeypatch)
    fake_lib("segv")
    target = tmp_path / "tiny.gguf"
    write_tiny_gguf(target)
    args = ["generate", "the cat", "--target", target, "--max-new-tokens", "4", "--json"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("backend torch:")]
    assert len(notes) == 1 and "SIGSEGV" in notes[0], err
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 4
    code, out, err = run_cli(monkeypatch, capsys, *args)  # the verdict is cached: same note
    assert code == 0 and "SIGSEGV" in err
