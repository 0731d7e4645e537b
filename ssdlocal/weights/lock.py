"""Trust on first use for hub downloads: the lock file `<config dir>/pairs.lock.json`.

The first pull (or first load) of a pair's model records the commit its revision
resolved to and every file's size, mtime and sha256. Later loads use that commit, not
wherever the revision points now, and check its files; a later pull that resolves to
another commit is refused until the user trusts it (`pull --update`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import AssetError
from ssdlocal.core.files import atomic_write_text, file_lock, sha256_file

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(frozen=True)
class Locked:
    """What was trusted for one model of a pair: its ref, commit and files."""

    repo: str
    revision: str
    commit: str
    files: dict[str, dict]  # path in the snapshot -> {"size", "mtime_ns", "sha256"}


def lock_path() -> Path:
    from ssdlocal.core.paths import config_dir

    return config_dir() / "pairs.lock.json"


def _key(pair: str, backend: str, role: str) -> str:
    return f"{pair}/{backend}/{role}"


def _read() -> dict:
    path = lock_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"version": VERSION, "models": {}}
    except (OSError, ValueError) as exc:
        raise AssetError(
            f"the lock file {path} is unreadable ({exc})",
            f"delete {path}: the next pull trusts what it downloads again",
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise AssetError(
            f"the lock file {path} is not an ssdlocal lock file",
            f"delete {path}: the next pull trusts what it downloads again",
        )
    return data


def _valid(entry: object) -> bool:
    """An entry as `record` writes it: repo, revision and commit strings, and files with
    an integer size and mtime and a sha256 string each."""
    if not isinstance(entry, dict) or not all(
        isinstance(entry.get(k), str) and entry[k] for k in ("repo", "revision", "commit")
    ):
        return False
    files = entry.get("files")
    return isinstance(files, dict) and all(
        isinstance(f, dict)
        and type(f.get("size")) is int
        and type(f.get("mtime_ns")) is int
        and isinstance(f.get("sha256"), str)
        for f in files.values()
    )


def get(pair: str, backend: str, role: str, repo: str, revision: str) -> Locked | None:
    """The trusted state for this model, if the same repo and revision were pulled before.
    A malformed entry is an error (dropping it would trust whatever comes next)."""
    key = _key(pair, backend, role)
    entry = _read()["models"].get(key)
    if entry is None:
        return None
    if not _valid(entry):
        path = lock_path()
        raise AssetError(
            f"the lock file {path} has a malformed entry {key!r} (not what `ssdlocal pull` writes)",
            f"delete the entry {key!r} from {path} (or the whole file, which ssdlocal wrote): "
            "the next pull trusts what it downloads again",
        )
    if entry["repo"] != repo or entry["revision"] != revision:
        return None  # the pair file now names another ref
    return Locked(entry["repo"], entry["revision"], entry["commit"], entry["files"])


def _describe(root: Path, name: str, known: dict | None) -> dict:
    st = (root / name).stat()  # follows the hub cache's symlinks to the blobs
    if known and known["size"] == st.st_size and known["mtime_ns"] == st.st_mtime_ns:
        return dict(known)  # unchanged since it was hashed: no need to read it again
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(root / name)}


def record(
    pair: str,
    backend: str,
    role: str,
    repo: str,
    revision: str,
    commit: str,
    root: Path,
    names: list[str],
    previous: Locked | None = None,
) -> Locked:
    """Trust the files `names` under `root` (a snapshot of `commit`) for this model.

    Files of `previous` (the same commit) that kept their size and mtime keep their hash."""
    same = previous.files if previous is not None and previous.commit == commit else {}
    files = {name: _describe(root, name, same.get(name)) for name in sorted(names)}
    locked = Locked(repo, revision, commit, files)
    path = lock_path()
    with file_lock(path.with_name(path.name + ".lock")):
        data = _read()
        data["models"][_key(pair, backend, role)] = {
            "repo": repo,
            "revision": revision,
            "commit": commit,
            "files": files,
        }
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    log.info("locked %s %s %s at commit %s (%d files)", pair, backend, role, commit, len(files))
    return locked


def verify(locked: Locked, root: Path, pair: str) -> None:
    """The trusted files are all under `root` and unchanged; AssetError otherwise.

    Size and mtime are compared; a file whose mtime alone moved (a copied cache) is hashed.
    """
    hint = (
        f"run `ssdlocal pull {pair}` to fetch the trusted files again, or "
        f"`ssdlocal pull {pair} --update` to trust what is there now"
    )
    for name, want in locked.files.items():
        path = root / name
        try:
            st = path.stat()
        except OSError:
            raise AssetError(
                f"{locked.repo}: {name} of trusted commit {locked.commit[:12]} is missing from {root}", hint
            ) from None
        if st.st_size == want["size"] and st.st_mtime_ns == want["mtime_ns"]:
            continue
        if st.st_size != want["size"] or sha256_file(path) != want["sha256"]:
            raise AssetError(
                f"{locked.repo}: {name} changed since it was pulled (commit "
                f"{locked.commit[:12]}; recorded {want['size']} bytes sha256 "
                f"{want['sha256'][:12]}…)",
                hint,
            )


def commits(pair: str, backend: str) -> dict[str, str]:
    """role -> trusted commit, for `ssdlocal pairs` (empty when nothing was locked)."""
    try:
        models = _read()["models"]
    except AssetError:
        return {}
    entries = {role: models.get(_key(pair, backend, role)) for role in ("target", "draft")}
    return {role: entry["commit"] for role, entry in entries.items() if _valid(entry)}


def snapshot_files(root: Path, allow: tuple[str, ...], ignore: tuple[str, ...] = ()) -> list[str]:
    """The files below a snapshot folder that a pull fetches (its allow / ignore patterns),
    as paths relative to it; files other tools put there are not ours to trust or refuse."""
    names = (str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return sorted(
        n
        for n in names
        if not n.endswith(".incomplete")
        and any(fnmatch.fnmatch(n, pat) for pat in allow)
        and not any(fnmatch.fnmatch(n, pat) for pat in ignore)
    )
