"""`ssdlocal pull ORG/NAME` and `ORG/NAME-GGUF:QUANT` against the fake hub (the same
huggingface_hub calls the real download path makes: model_info, snapshot_download,
hf_hub_download), and `ssdlocal rm`.

A pull shows its plan (files, bytes, whether it fits here), asks (or needs --yes without a
terminal), downloads the target, finds a draft among smaller siblings of the family and
the registry's drafts, verifies it with the pair check (a safetensors draft by its tokenizer
before its weights; a GGUF draft once fetched, removed again when it fails), falls back to
suffix drafting, and writes a pair file that `generate --pair` loads offline. `rm` frees a
pair's downloads (keeping a repository another pulled pair uses) and refuses anything
outside the caches.
"""

from __future__ import annotations

import json
import tomllib
from functools import partial
from pathlib import Path

import pytest
from support import cli as cli_helpers
from support.cli import run_cli
from support.hub import COMMIT

assert_clean_error = partial(cli_helpers.assert_clean_error, skip=("pull ", "  ", "    "))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """What pull and rm build or remove in ssdlocal's cache (GGUF metadata) stays in the test's."""
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}


def _swapped_tokenizer(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same files with two token texts trading ids: the pair check refuses them."""
    data = json.loads(files["tokenizer.json"])
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 200][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return {**files, "tokenizer.json": json.dumps(data).encode()}


@pytest.fixture
def safetensors_repos(hub, tiny_dir):
    """org/Tiny-8B-Instruct (llama) with siblings: 1B (another tokenizer), 3B (compatible)."""
    target = _files(tiny_dir["llama"])
    small = _files(tiny_dir["small_llama"])
    hub.add_repo("org/Tiny-8B-Instruct", {**target, "original/params.json": b"{}", "pytorch_model.bin": b"x" * 10})
    hub.add_repo("org/Tiny-1B-Instruct", _swapped_tokenizer(small))
    hub.add_repo("org/Tiny-3B-Instruct", small)
    return hub


@pytest.fixture
def gguf_repos(hub, tmp_path):
    """org/Tiny-7B-Instruct-GGUF (Q4_K_M and Q8_0 files) with siblings 0.5B (another
    tokenizer) and 1.5B (compatible), as Q8_0 files."""
    from support.tiny_gguf import write_tiny_gguf

    made = tmp_path / "made"
    made.mkdir()
    write_tiny_gguf(made / "big.gguf", layers=3)
    write_tiny_gguf(made / "small.gguf", seed=1)
    write_tiny_gguf(made / "other.gguf", seed=2, swap_tokens=True)
    big = (made / "big.gguf").read_bytes()
    hub.add_repo(
        "org/Tiny-7B-Instruct-GGUF",
        {"Tiny-7B-Instruct-Q4_K_M.gguf": big, "Tiny-7B-Instruct-Q8_0.gguf": big + b"", "README.md": b"# tiny"},
    )
    hub.add_repo("org/Tiny-0.5B-Instruct-GGUF", {"Tiny-0.5B-Instruct-Q8_0.gguf": (made / "other.gguf").read_bytes()})
    hub.add_repo("org/Tiny-1.5B-Instruct-GGUF", {"Tiny-1.5B-Instruct-Q8_0.gguf": (made / "small.gguf").read_bytes()})
    return hub


def _pair_file(tmp_path: Path, name: str) -> dict:
    return tomllib.loads((tmp_path / "config" / "pairs" / f"{name}.toml").read_text())


def test_pull_a_safetensors_repository_finds_and_checks_a_draft(monkeypatch, capsys, safetensors_repos, tmp_path):
    hub = safetensors_repos
    code, out, err = run_cli(monkeypatch, capsys, "pull", "org/Tiny-8B-Instruct", "--yes")
    assert code == 0, err
    # the plan, before anything downloads
    assert f"pull org/Tiny-8B-Instruct at commit {COMMIT[:12]} (safetensors) as pair tiny-8b-instruct:" in out
    assert "target org/Tiny-8B-Instruct: " in out and "model.safetensors" in out
    assert "draft org/Tiny-1B-Instruct: " in out and "a smaller model of the llama3 family" in out
    assert "total: " in out and "fits here (weights " in out
    # the 1B's tokenizer fails the check: its weights are never fetched, its files go again
    assert "draft org/Tiny-1B-Instruct fails the pair check (token text check failed" in err
    assert not any(key.startswith("org/Tiny-1B-Instruct/model") for key in hub.copies)
    assert not (tmp_path / "hf_home" / "hub" / "models--org--Tiny-1B-Instruct").exists()
    assert "draft org/Tiny-3B-Instruct: a smaller model of the llama3 family; it passed the pair check" in out
    # only the top-level safetensors, config and tokenizer files
    assert "org/Tiny-8B-Instruct/original/params.json" not in hub.copies
    assert "org/Tiny-8B-Instruct/pytorch_model.bin" not in hub.copies
    pair = _pair_file(tmp_path, "tiny-8b-instruct")
    assert pair["target"] == {"repo": "org/Tiny-8B-Instruct", "revision": COMMIT, "bf16_gb": pytest.approx(0, abs=1)}
    assert pair["draft"]["repo"] == "org/Tiny-3B-Instruct" and pair["draft"]["revision"] == COMMIT
    # the pair loads offline, like a registry pair, and generates
    from ssdlocal.weights.hub import resolve_pair_paths

    hub.unreachable = True
    target, draft = resolve_pair_paths("tiny-8b-instruct")
    assert Path(target).parent.name == "snapshots" and "Tiny-3B" in draft
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "the cat",
        "--pair",
        "tiny-8b-instruct",
        "--max-new-tokens",
        "4",
        "--dtype",
        "float32",
        "--mode",
        "sd",
        "--k",
        "2",
    )
    assert code == 0, err


def test_pull_a_gguf_repository_with_a_quantization(monkeypatch, capsys, gguf_repos, tmp_path):
    hub = gguf_repos
    code, out, err = run_cli(monkeypatch, capsys, "pull", "org/Tiny-7B-Instruct-GGUF:Q4_K_M", "--yes")
    assert code == 0, err
    assert "(GGUF Q4_K_M) as pair tiny-7b-instruct-q4_k_m:" in out
    assert "Tiny-7B-Instruct-Q4_K_M.gguf" in out and "Tiny-7B-Instruct-Q8_0.gguf" not in out
    assert "org/Tiny-7B-Instruct-GGUF/Tiny-7B-Instruct-Q8_0.gguf" not in hub.copies  # one quantization only
    assert "draft org/Tiny-0.5B-Instruct-GGUF fails the pair check (token text check failed" in err
    assert not (tmp_path / "hf_home" / "hub" / "models--org--Tiny-0.5B-Instruct-GGUF").exists()
    metadata = [p.name for p in (tmp_path / "cache" / "gguf-meta").iterdir() if not p.name.endswith(".lock")]
    assert sorted(m.rsplit("-", 1)[0] for m in metadata) == ["Tiny-1.5B-Instruct-Q8_0", "Tiny-7B-Instruct-Q4_K_M"]
    assert "draft org/Tiny-1.5B-Instruct-GGUF: a smaller model of the qwen2.5 family; it passed" in out
    pair = _pair_file(tmp_path, "tiny-7b-instruct-q4_k_m")
    assert pair["weights"] == "gguf"
    assert pair["llamacpp"]["target"]["filename"] == "Tiny-7B-Instruct-Q4_K_M.gguf"
    assert pair["llamacpp"]["draft"] == {
        "repo": "org/Tiny-1.5B-Instruct-GGUF",
        "revision": COMMIT,
        "filename": "Tiny-1.5B-Instruct-Q8_0.gguf",
        "quant": "Q8_0",
        "size_gb": pytest.approx(0, abs=1),
    }
    from ssdlocal.core.models import BackendName
    from ssdlocal.weights.hub import resolve_pair_paths

    hub.unreachable = True
    for backend in (BackendName.LLAMACPP, BackendName.TORCH):  # torch reads the GGUF files too
        target, draft = resolve_pair_paths("tiny-7b-instruct-q4_k_m", backend=backend, quantization="auto")
        assert target.endswith("Tiny-7B-Instruct-Q4_K_M.gguf") and draft.endswith("Tiny-1.5B-Instruct-Q8_0.gguf")


def test_no_draft_passes_falls_back_to_suffix_drafting(monkeypatch, capsys, hub, tiny_dir, tmp_path):
    hub.add_repo("org/Lonely-8B-Instruct", _files(tiny_dir["llama"]))
    code, out, err = run_cli(monkeypatch, capsys, "pull", "org/Lonely-8B-Instruct", "-y")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("draft: ")]
    assert len(lines) == 1, out
    assert "no smaller model of the llama3 family passed the pair check" in lines[0]
    assert "meta-llama/Llama-3.2-1B-Instruct: " in lines[0]  # the registry's llama3 draft, not on this hub
    assert lines[0].endswith("the pair drafts with suffix proposals")
    assert _pair_file(tmp_path, "lonely-8b-instruct")["draft"] == "suffix"
    from ssdlocal.weights.hub import resolve_pair_paths

    assert resolve_pair_paths("lonely-8b-instruct")[1] == "suffix"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "the cat",
        "--pair",
        "lonely-8b-instruct",
        "--max-new-tokens",
        "4",
        "--dtype",
        "float32",
        "--mode",
        "sd",
    )
    assert code == 0, err


def test_without_a_terminal_a_pull_needs_yes(monkeypatch, capsys, safetensors_repos):
    hub = safetensors_repos
    code, out, err = run_cli(monkeypatch, capsys, "pull", "org/Tiny-8B-Instruct")
    assert_clean_error(code, err, 2, "no terminal to ask", "ssdlocal pull org/Tiny-8B-Instruct --yes")
    assert "total: " in out  # the plan was shown
    assert {c["fn"] for c in hub.calls} == {"info"} and hub.copies == {}  # nothing downloaded


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["org/Nothing-7B"], 1, ["org/Nothing-7B was not found on the hub", "check the repository id"]),
        (["org/Tiny-7B-Instruct-GGUF"], 2, ["is a GGUF repository", "Tiny-7B-Instruct-GGUF:Q4_K_M", "Q8_0"]),
        (["org/Tiny-7B-Instruct-GGUF:Q5_K_M"], 2, ["has no Q5_K_M GGUF file", "it has Q4_K_M, Q8_0"]),
        (["org/Tiny-7B-Instruct-GGUF:Q4 K"], 2, ["'Q4 K' is not a GGUF quantization"]),
        (["org/Tiny-7B-Instruct-GGUF:Q4_K_M", "--revision", "v9"], 1, ["has no revision 'v9'", "--revision"]),
    ],
)
def test_bad_repository_input(monkeypatch, capsys, gguf_repos, args, code, needles):
    assert_clean_error(*run_cli(monkeypatch, capsys, "pull", *args, "--yes")[::2], code, *needles)


def test_unreachable_hub_and_gated_repository(monkeypatch, capsys, safetensors_repos):
    hub = safetensors_repos
    hub.unreachable = True
    code, _, err = run_cli(monkeypatch, capsys, "pull", "org/Tiny-8B-Instruct", "--yes")
    assert_clean_error(code, err, 1, "cannot list org/Tiny-8B-Instruct", "qwen2.5-coder-1.5b-offline")
    hub.unreachable = False
    hub.gated.add("org/Tiny-8B-Instruct")
    code, out, err = run_cli(monkeypatch, capsys, "pull", "org/Tiny-8B-Instruct", "--yes")
    assert "is gated: accept its licence" in out
    assert_clean_error(code, err, 1, "org/Tiny-8B-Instruct is gated", "HF_TOKEN")


def test_rm_frees_a_pulled_model_and_keeps_a_shared_draft(monkeypatch, capsys, safetensors_repos, tiny_dir, tmp_path):
    hub = safetensors_repos
    hub.add_repo("org/Tiny-70B-Instruct", _files(tiny_dir["llama"]))
    for repo in ("org/Tiny-8B-Instruct", "org/Tiny-70B-Instruct"):
        code, out, err = run_cli(monkeypatch, capsys, "pull", repo, "--yes")
        assert code == 0, err
        assert "draft org/Tiny-3B-Instruct: " in out
    hub_dir = tmp_path / "hf_home" / "hub"
    code, out, err = run_cli(monkeypatch, capsys, "rm", "tiny-8b-instruct")
    assert code == 0, err
    assert "kept org/Tiny-3B-Instruct (also used by tiny-70b-instruct)" in out
    assert "removed hub/models--org--Tiny-8B-Instruct (" in out and "freed " in out
    assert not (hub_dir / "models--org--Tiny-8B-Instruct").exists()
    assert (hub_dir / "models--org--Tiny-3B-Instruct").exists()
    assert not (tmp_path / "config" / "pairs" / "tiny-8b-instruct.toml").exists()
    code, out, err = run_cli(monkeypatch, capsys, "pairs", "--json")
    assert "tiny-8b-instruct" not in {row["name"] for row in json.loads(out)}
    # by repository id: the last pair using the draft takes it along
    code, out, err = run_cli(monkeypatch, capsys, "rm", "org/Tiny-70B-Instruct")
    assert code == 0, err
    assert "removed hub/models--org--Tiny-3B-Instruct (" in out
    assert not (hub_dir / "models--org--Tiny-3B-Instruct").exists()
    code, out, err = run_cli(monkeypatch, capsys, "rm", "org/Tiny-70B-Instruct")
    assert_clean_error(code, err, 2, "no pulled model is org/Tiny-70B-Instruct")


def test_rm_of_a_registry_pair_keeps_the_pair_and_refuses_other_files(monkeypatch, capsys, hub, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "rm", "fake-pair")
    assert code == 0, err
    assert "removed hub/models--org--target" in out and "removed hub/models--org--draft" in out
    assert "pair file" not in out  # a pair pull did not write stays
    code, out, _ = run_cli(monkeypatch, capsys, "rm", "fake-pair")
    assert "nothing of fake-pair is downloaded" in out
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"x")
    code, _, err = run_cli(monkeypatch, capsys, "rm", str(mine))
    assert_clean_error(code, err, 2, "outside ssdlocal's cache and the Hugging Face cache")
    assert (mine / "model.safetensors").exists()
    local = tmp_path / "pairs" / "local.toml"
    local.write_text('name = "local-pair"\nsource = "local"\n[target]\npath = "t"\n[draft]\npath = "d"\n')
    code, _, err = run_cli(monkeypatch, capsys, "rm", "local-pair")
    assert_clean_error(code, err, 2, "names your own files")


def test_draft_candidates_come_from_the_registry_and_the_family(monkeypatch, tmp_path):
    from ssdlocal.weights.drafts import candidates, family_of, size_of, stem_of
    from ssdlocal.weights.pairs import load_pairs
    from ssdlocal.weights.repo import RepoSpec, parse_spec

    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("SSDLOCAL_PAIRS_PATH", raising=False)
    registry = list(load_pairs().values())
    assert parse_spec("bartowski/Qwen2.5-7B-Instruct-GGUF:q4_k_m") == RepoSpec(
        "bartowski/Qwen2.5-7B-Instruct-GGUF", "Q4_K_M"
    )
    assert parse_spec("qwen2.5-7b") is None and parse_spec("pairs/x.toml") is None
    assert size_of("Qwen/Qwen3-0.6B") == 0.6 and size_of("google/gemma-3-270m") == 0.27
    assert stem_of("Qwen/Qwen2.5-Coder-14B-Instruct") == "qwen2.5-coder"
    # the registry pair's own draft first
    first = candidates("Qwen/Qwen2.5-7B-Instruct", "qwen2.5", registry)[0]
    assert (first.repo, first.why) == ("Qwen/Qwen2.5-0.5B-Instruct", "the draft of the registry pair qwen2.5-7b")
    # a size the registry lacks: its family by the name's stem, the same line's draft first
    assert family_of("bartowski/Qwen2.5-Coder-14B-Instruct-GGUF", None, registry) == "qwen2.5"
    found = candidates("bartowski/Qwen2.5-Coder-14B-Instruct-GGUF", "qwen2.5", registry, "Q4_K_M")
    assert found[0].repo == "bartowski/Qwen2.5-Coder-0.5B-Instruct-GGUF"
    assert found[0].filename == "Qwen2.5-Coder-0.5B-Instruct-Q8_0.gguf"
    assert "bartowski/Qwen2.5-Coder-3B-Instruct-GGUF" in [c.repo for c in found]  # a sibling
    assert all("14B" not in c.repo and "32B" not in c.repo for c in found)  # never larger
    # the model type the hub read names the family where the name does not
    assert family_of("someone/Mystery-8B", "llama", registry) == "llama3"
    assert candidates("someone/Mystery-8B", "llama3", registry)[0].repo == "someone/Mystery-1B"
    # a registry pair's draft head is no draft model: never a candidate
    for target in ("meta-llama/Llama-3.1-70B-Instruct", "Qwen/Qwen3-32B"):  # larger than the heads named 8B
        repos = [c.repo for c in candidates(target, family_of(target, None, registry), registry)]
        assert repos and not {"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "z-lab/Qwen3-8B-DFlash-b16"} & set(repos)


def test_generated_pair_file_round_trips(monkeypatch, tmp_path):
    from ssdlocal.weights.pairs import parse_pair
    from ssdlocal.weights.pulled import PullPlan, pair_toml, to_pair
    from ssdlocal.weights.repo import RepoSpec, Selection

    sel = Selection("o/A-7B-GGUF", COMMIT, {"A-7B-Q4_K_M.gguf": 4_000_000_000}, "A-7B-Q4_K_M.gguf", "Q4_K_M")
    plan = PullPlan(RepoSpec("o/A-7B-GGUF", "Q4_K_M"), "a-7b-q4_k_m", "qwen2.5", sel)
    pair = to_pair(plan)
    path = tmp_path / "a.toml"
    path.write_text(pair_toml(pair, plan.spec))
    back = parse_pair(path)
    assert back.draft is None and back.draft_word == "suffix" and back.weights == "gguf"
    assert back.gguf_target == pair.gguf_target and back.memory_gb("torch", "auto") == (4.0, 0.0)


def test_real_client_lists_nothing_with_the_hub_unreachable(monkeypatch, capsys, tmp_path):
    """No fake: huggingface_hub's own model_info, pointed at a closed local port."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert huggingface_hub.model_info.__module__.startswith("huggingface_hub")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "Qwen/Qwen2.5-7B-Instruct", "--yes")
    assert_clean_error(code, err, 1, "cannot list Qwen/Qwen2.5-7B-Instruct on the Hugging Face hub", "--target/--draft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "Qwen/Qwen2.5-7B-Instruct", "--yes")
    assert_clean_error(code, err, 1, "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE")
