"""Registry pairs whose draft is a draft head (`[draft] head = "eagle3"` in the pair file):
`pairs` lists them as heads (torch, SD), `pull` downloads the target and the head (the fake
hub), `generate --pair` runs the head as `--draft DIR` does (a HeadDraft, SD; the pair's
kind counts even where the head's config.json names a plain architecture, as the EAGLE-3
authors' checkpoints do), and llama.cpp is refused with a hint."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from support import cli as cli_helpers
from support.cli import run_cli
from support.tiny_heads import make_eagle3

from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import BackendName, HeadDraft

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
assert_clean_error = partial(cli_helpers.assert_clean_error, skip=("pulling ",))

HEAD_PAIR = """name = "{name}"
source = "{source}"
family = "llama3"
[target]
{where} = "{target}"
bf16_gb = 0.01
[draft]
head = "eagle3"
{where} = "{head}"
bf16_gb = 0.002
[torch]
allow_patterns = ["*.json", "*.safetensors", "*.bin", "tokenizer*"]
ignore_patterns = ["original/*"]
"""


def _as_published(head: Path) -> Path:
    """The head as its authors publish it: a plain architecture in config.json (only the
    pair file says it is a head) and the weights in pytorch_model.bin."""
    from safetensors.torch import load_file

    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    torch.save(load_file(str(head / "model.safetensors")), head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()
    return head


@pytest.fixture(scope="module")
def published_head(tiny_dir, tmp_path_factory):
    return _as_published(make_eagle3(tmp_path_factory.mktemp("eagle3"), tiny_dir["llama"]))


@pytest.fixture
def local_head_pair(tmp_path, monkeypatch, tiny_dir, published_head):
    pair_file = tmp_path / "tiny-eagle3.toml"
    pair_file.write_text(
        HEAD_PAIR.format(
            name="tiny-eagle3", source="local", where="path", target=tiny_dir["llama"], head=published_head
        )
    )
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(pair_file))
    return pair_file


def test_the_pairs_command_marks_head_pairs(monkeypatch, capsys, local_head_pair):
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    head, model = rows["tiny-eagle3"], rows["llama-3.1-8b"]
    assert (head["draft_head"], head["ssd"], head["backends"]) == ("eagle3", False, ["torch"])
    assert head["draft"].endswith("(eagle3 head)") and head["downloaded"] is True
    assert head["fits"] and head["placement"] == "target cpu, eagle3 draft head beside it"
    assert (model["draft_head"], model["ssd"]) == (None, True)
    assert rows["llama-3.1-8b-eagle3"]["draft_head"] == "eagle3" and rows["qwen3-8b-dflash"]["draft_head"] == "dflash"
    code, out, err = run_cli(monkeypatch, capsys, "pairs")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("tiny-eagle3 "))
    assert "torch (head)" in line and "+head" in line and "/" not in line.split("(head)")[1]
    assert "(head): a draft head, run beside the target: torch only, SD only" in out


def test_generate_with_a_head_pair_runs_the_head_in_sd(monkeypatch, capsys, local_head_pair, published_head):
    from ssdlocal.cli.options import ModelOptions, SpecOptions
    from ssdlocal.cli.resolve import engine_config

    config = engine_config(ModelOptions(pair="tiny-eagle3", dtype="float32"), SpecOptions())
    assert config.spec.draft == HeadDraft(str(published_head), "eagle3")
    base = ("--pair", "tiny-eagle3", "--dtype", "float32", "--max-new-tokens", "8")
    code, out, err = run_cli(monkeypatch, capsys, "generate", "The quick brown fox", *base)
    assert code == 0, err
    assert "mode sd" in err and "draft head" in err and out.strip()
    code, _, err = run_cli(monkeypatch, capsys, "generate", "The quick brown fox", *base, "--mode", "ssd")
    assert code != 0 and "SD only" in err and "Traceback" not in err
    code, out, err = run_cli(monkeypatch, capsys, "check", *base)
    assert code == 0, err
    assert "greedy AR / SD on 3 prompts" in out and "SD reproduces AR" in out


def test_bench_of_a_head_pair_runs_ar_and_sd_and_says_why_not_ssd(monkeypatch, capsys, local_head_pair, tmp_path):
    out = tmp_path / "bench"
    args = ("--pair", "tiny-eagle3", "--dtype", "float32", "--max-new-tokens", "6", "--limit", "1", "--repeats", "1")
    code, _, err = run_cli(monkeypatch, capsys, "bench", *args, "--no-chat", "--no-pin", "--project", "--out", str(out))
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["aggregates"]) == {"ar", "sd"} and "SD only" in doc["skipped"]["ssd"]
    assert doc["exactness"]["sd"]["status"] == "exact" and "projections" in doc


def test_a_head_pair_on_llama_cpp_is_refused(monkeypatch, capsys, local_head_pair):
    from ssdlocal.weights.hub import resolve_pair_paths

    with pytest.raises(UsageError) as info:
        resolve_pair_paths("tiny-eagle3", backend=BackendName.LLAMACPP)
    assert "runs on the torch backend only" in info.value.message and "--target-backend torch" in info.value.hint
    code, _, err = run_cli(
        monkeypatch, capsys, "generate", "Hi", "--pair", "tiny-eagle3", "--target-backend", "llamacpp"
    )
    assert_clean_error(code, err, 2, "eagle3 draft head", "torch backend only")


def test_pull_a_head_pair_downloads_the_target_and_the_head(monkeypatch, capsys, hub, tmp_path, published_head):
    head_files = {p.name: p.read_bytes() for p in published_head.iterdir()}
    hub.add_repo("org/eagle3-head", head_files)
    pair_file = tmp_path / "pairs" / "fake-eagle3.toml"  # beside fake.toml, in SSDLOCAL_PAIRS_PATH
    pair_file.write_text(
        HEAD_PAIR.format(
            name="fake-eagle3", source="hf", where="repo", target="org/target", head="org/eagle3-head"
        ).replace('repo = "org/target"', 'repo = "org/target"\nrevision = "main"')
    )
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-eagle3")
    assert code == 0, err
    assert "org/eagle3-head (eagle3 head)" in err
    head_snap = Path(out.split("draft: ")[1].split(" (commit")[0])
    assert sorted(p.name for p in head_snap.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert [c["repo"] for c in hub.calls if c["fn"] == "snapshot"] == ["org/target", "org/eagle3-head"]
    from ssdlocal.weights.hub import resolve_pair_paths

    hub.unreachable = True  # pulled: found without the network, the head as the draft
    assert Path(resolve_pair_paths("fake-eagle3")[1]) == head_snap
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json")
    row = next(r for r in json.loads(out) if r["name"] == "fake-eagle3")
    assert row["downloaded"] is True and row["draft_head"] == "eagle3" and row["locked"]["draft"]
    hub.unreachable = False
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-eagle3", "--backend", "llamacpp")
    assert_clean_error(code, err, 2, "runs on the torch backend only", "--backend torch")
    code, out, err = run_cli(monkeypatch, capsys, "rm", "fake-eagle3")  # frees the target and the head
    assert code == 0, err
    assert "removed hub/models--org--target" in out and "removed hub/models--org--eagle3-head" in out
    assert not head_snap.exists()


def test_auto_placement_puts_a_head_on_the_targets_device(tiny_dir, published_head):
    """`--target-device auto`: a draft model takes a GPU of its own, a head the target's."""
    from ssdlocal.placement.auto import auto_devices
    from ssdlocal.placement.inventory import GPU, DeviceInventory

    two_gpus = DeviceInventory((GPU(0, "a", 24.0, 23.5), GPU(1, "b", 24.0, 23.5)), 8, 64.0, 60.0)
    target, draft = str(tiny_dir["llama"]), str(tiny_dir["draft_llama"])
    assert auto_devices(target, draft, "float32", two_gpus) == (("cuda:0",), "cuda:1")
    head = str(published_head)
    assert auto_devices(target, head, "float32", two_gpus, draft_beside=True) == (("cuda:0",), "cuda:0")
