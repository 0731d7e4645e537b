"""A fake Hugging Face hub for tests: repos served from a local "remote" folder.

`FakeHub` replaces huggingface_hub.snapshot_download / hf_hub_download and copies files
from `remote/<org>/<name>/` into the hub cache layout; like the real client (huggingface_hub
>= 1.0) it writes each file to a temporary name and deletes it when the transfer breaks,
so a cut-off file starts over. `model_info` answers as the hub's API does (a real
huggingface_hub ModelInfo: the commit, every file with its size, the model type read from
config.json or the GGUF header), or raises RepositoryNotFoundError / RevisionNotFoundError.
The `hub` fixture (conftest.py) registers `fake-pair`.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path


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
            if snapshot.is_dir() and not list(snapshot.rglob("*.incomplete")) and any(snapshot.iterdir()):
                return
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")
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
                raise httpx2.ReadError("peer closed connection without sending complete message body")
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

    def model_info(self, repo_id, *, revision=None, files_metadata=False, token=None, **kwargs):
        import httpx2
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
        from huggingface_hub.hf_api import ModelInfo

        self.calls.append({"fn": "info", "repo": repo_id, "revision": revision, "token": token})
        url = f"https://hf.co/api/models/{repo_id}/revision/{revision}"
        if self.unreachable:
            raise httpx2.ConnectError("[Errno 111] Connection refused")
        root = self.remote / repo_id
        if not root.is_dir():
            response = httpx2.Response(404, request=httpx2.Request("GET", url))
            raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for url: {url}", response=response)
        if revision not in (None, "main", "v1.0", self.commit) and not re.fullmatch(r"[0-9a-f]{40}", revision or ""):
            response = httpx2.Response(404, request=httpx2.Request("GET", url))
            raise RevisionNotFoundError(f"404 Client Error. Revision Not Found for url: {url}", response=response)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        siblings = [
            {"rfilename": str(p.relative_to(root)), **({"size": p.stat().st_size} if files_metadata else {})}
            for p in files
        ]
        info = {"id": repo_id, "sha": self.commit, "siblings": siblings, "gated": repo_id in self.gated}
        config = root / "config.json"
        if config.is_file():
            import json

            info["config"] = {"model_type": json.loads(config.read_text()).get("model_type")}
        gguf = next((p for p in files if p.suffix == ".gguf"), None)
        if gguf is not None:
            from ssdlocal.weights.formats.gguf import GGUFHeader

            try:
                info["gguf"] = {"architecture": GGUFHeader.read(gguf).metadata.get("general.architecture")}
            except Exception:  # noqa: BLE001 - a file that is no GGUF: the hub reports no header either
                pass
        return ModelInfo(**info)

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
            raise RemoteEntryNotFoundError(f"404 Client Error. Entry Not Found for url: {url}", response=response)
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
