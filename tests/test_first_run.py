"""A newcomer's first run of the offline pair, on tiny GGUF stand-ins: what the cache keeps
(only what the run loads: the GGUF files, their int4 caches and their metadata, never a
bf16 copy), what the terminal shows while it prepares (a bar per stage, on stderr), and
that stdout carries only the answer (or the --json object).
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture
def offline_pair(tmp_path, monkeypatch):
    """The built-in pair's two GGUF files, replaced by tiny Q4_K_M qwen2 ones, in a fresh
    cache; `fetch_gguf` hands them out as the download would."""
    import tiny_gguf

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
    from ssdlocal.backends.torch import gguf_convert

    monkeypatch.setattr(gguf_convert, "_convert", lambda *a, **k: pytest.fail("bf16 conversion"))
    cache, _ = offline_pair
    code, out, err = run_cli(monkeypatch, capsys, "generate", "Hello", "--target-backend", "torch",
                             "--max-new-tokens", "4", "--json")  # fmt: skip
    assert code == 0, err
    json.loads(out)  # stdout: the JSON object only
    assert not (cache / "converted").exists(), _dirs(cache / "converted")
    built = [d for d in _dirs(cache / "quantized") if not d.endswith(".lock")]
    assert len(built) == 2 and all("-int4-" in d for d in built), built
