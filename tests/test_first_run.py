"""A newcomer's first run of the offline pair, on tiny GGUF stand-ins: what the cache keeps
(only what the run loads: the GGUF files, their int4 caches and their metadata, never a
bf16 copy), what the terminal shows while it prepares (a bar per stage, on stderr), and
that stdout carries only the answer (or the --json object).
"""

from __future__ import annotations

import json

import pytest
from support.cli import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture
def offline_pair(tmp_path, monkeypatch):
    """The built-in pair's two GGUF files, replaced by tiny Q4_K_M qwen2 ones, in a fresh
    cache; `fetch_gguf` hands them out as the download would."""
    from support import tiny_gguf

    from ssdlocal.weights import assets

    files = {}
    for seed, name in enumerate((assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT)):
        model = tiny_gguf.make_hf_model("qwen2", seed=7 + seed, tie=True)
        files[name] = tiny_gguf.write_gguf(tmp_path / f"{name}.gguf", model, "qwen2", "q4_k_m")
    cache = tmp_path / "cache"
    monkeypatch.setenv("SSDLOCAL_CACHE", str(cache))
    monkeypatch.setattr(assets, "fetch_gguf", lambda name, progress=None, cache=None: files[name])
    return cache, files


def _dirs(root):
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_first_run_keeps_no_bf16_copy(offline_pair, monkeypatch, capsys):
    """The default run loads int4 weights: no `converted` (bf16) directory is ever written,
    and the quantized caches of both models are there afterwards."""
    from ssdlocal.weights.formats import convert as gguf_convert

    monkeypatch.setattr(gguf_convert, "_convert", lambda *a, **k: pytest.fail("bf16 conversion"))
    cache, _ = offline_pair
    code, out, err = run_cli(
        monkeypatch, capsys, "generate", "Hello", "--target-backend", "torch", "--max-new-tokens", "4", "--json"
    )
    assert code == 0, err
    json.loads(out)  # stdout: the JSON object only
    assert not (cache / "converted").exists(), _dirs(cache / "converted")
    built = [d for d in _dirs(cache / "quantized") if not d.endswith(".lock")]
    assert len(built) == 2 and all("-int4-" in d for d in built), built


def test_first_run_shows_each_stage_on_stderr_and_keeps_stdout_clean(offline_pair, monkeypatch, capsys):
    """A --json first run: every preparation step appears on stderr by name with its unit
    (plain lines: stderr is not a terminal here), the mode line before the answer; stdout
    holds exactly one JSON object."""
    code, out, err = run_cli(
        monkeypatch, capsys, "generate", "Hello", "--target-backend", "torch", "--max-new-tokens", "4", "--json"
    )
    assert code == 0, err
    payload = json.loads(out)
    assert payload["stats"]["mode_reason"].startswith("target and draft share the CPU")
    for stage in (
        "quantizing qwen2.5-coder-1.5b to int4: ",
        "quantizing qwen2.5-coder-0.5b to int4: ",
        "reading tokenizer: qwen2.5-coder-1.5b",
        "loading qwen2.5-coder-1.5b (int4): ",
        "loading qwen2.5-coder-0.5b (int4): ",
        "calibrating target and draft: ",
    ):
        assert stage in err, (stage, err)
    assert " MB" in err or " kB" in err  # quantizing and loading count bytes
    lines = err.splitlines()
    mode = [i for i, line in enumerate(lines) if line.startswith("mode sd: target and draft share the CPU")]
    assert len(mode) == 1 and len(lines[mode[0]]) <= 80, lines
    assert "\x1b" not in err  # no terminal codes in a log


def test_a_second_run_prepares_nothing(offline_pair, monkeypatch, capsys):
    run_cli(monkeypatch, capsys, "generate", "Hi", "--target-backend", "torch", "--max-new-tokens", "2")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "Hi", "--target-backend", "torch", "--max-new-tokens", "2")
    assert code == 0, err
    assert "quantizing" not in err and "reading tokenizer" not in err, err
    assert "loading qwen2.5-coder-1.5b (int4)" in err  # loading is shown every time


def test_the_mode_line_comes_before_the_first_token(monkeypatch):
    """generate prints `mode X: why` on stderr before any token reaches stdout."""
    import sys

    from ssdlocal.cli import render
    from ssdlocal.core.config import Mode, SamplingParams
    from ssdlocal.core.events import DoneEvent, Output, TokensEvent
    from ssdlocal.core.metrics import Metrics
    from ssdlocal.placement.mode import ModeChoice

    order = []

    class Fake:
        choice = ModeChoice(Mode.SD, "the long story", "the short story")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def generate(self, prompts, params, chat=False, grammars=None):
            yield TokensEvent(0, (1,), "Hello")
            yield DoneEvent((Output("Hello", (1,), "eos"),), Metrics(mode="sd", mode_reason="the long story", tokens=1))

    class Out:
        def write(self, text):
            order.append(("stdout", text))

        def flush(self):
            pass

    monkeypatch.setattr(render, "load_engine", lambda config: Fake())
    monkeypatch.setattr(render.err_console, "print", lambda text, **k: order.append(("stderr", str(text))))
    monkeypatch.setattr(sys, "stdout", Out())
    render.run_generate(None, ["x"], SamplingParams(), chat=False, as_json=False)
    assert order[0] == ("stderr", "[dim]mode sd: the short story[/dim]"), order
    assert order[1] == ("stdout", "Hello"), order
