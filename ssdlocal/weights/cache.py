"""What the cache directory holds, how big each entry is, and removing entries safely.

Entries by kind: downloaded GGUF files (`gguf`), the torch backend's quantized weights
(`quantized`, what a default run loads), bf16 conversions (`converted`, only for
`--quantization none`), tokenizer + config extracted from a GGUF (`metadata`), llama.cpp
test verdicts (`probes`), remembered suffix memory (`suffix`), leftover downloads
(`wheels`), timings of this machine (`calibration`, core/measured.py) and small indexes
(`index`). Removal never races a build: it takes the lock the
builder holds (and refuses while someone else holds it), renames the entry out of sight
first (so nothing half-deleted is ever trusted), then deletes it. Every entry is rebuilt
or fetched again by the next run that needs it. A model's repository in the Hugging Face
hub cache (`hub`, what `pull` fetched) is removed the same way (`hub_entry`,
`remove_hub_file`); nothing outside the two caches is ever removed. No UI here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import AssetError, UsageError
from ssdlocal.core.paths import cache_dir

# folder -> (kind, what it is for)
KINDS = {
    "gguf": ("gguf", "downloads; llama.cpp runs them, torch caches start from them"),
    "quantized": ("quantized", "int4/int8 weights torch loads (the default run)"),
    "converted": ("converted", "bf16 weights, only for --quantization none"),
    "gguf-meta": ("metadata", "tokenizer and config of a GGUF file"),
    "probes": ("probes", "llama.cpp test runs on this machine"),
    "suffix": ("suffix", "suffix memory (--persist-suffix-memory)"),
    "wheels": ("wheels", "PyPI downloads of an interrupted first run"),
    "calibration": ("calibration", "timings of this machine (start-up calibration, prefill)"),
    "gguf-keys": ("index", "file digests"),
    "gguf-tokenizers": ("index", "llama.cpp tokenizer files"),
}
HUB = ("hub", "a model's repository in the Hugging Face cache (`ssdlocal pull`)")
_SIDE_FILES = (".verified.json", ".lock", ".partial")  # next to a GGUF file


@dataclass(frozen=True)
class CacheEntry:
    kind: str
    name: str  # unique within the cache: "<folder>/<entry>"
    path: Path
    size: int  # bytes on disk

    @property
    def what(self) -> str:
        return next((what for kind, what in (*KINDS.values(), HUB) if kind == self.kind), self.kind)


def _size(path: Path) -> int:
    """Bytes on disk; links are not followed (the hub cache links snapshots to blobs)."""
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                item = Path(root) / f
                total += 0 if item.is_symlink() else item.stat().st_size
    return total


def _roots() -> tuple[Path, ...]:
    from ssdlocal.weights.hub import hf_cache_dir

    return cache_dir().resolve(), hf_cache_dir().resolve()


def inside_caches(path: Path) -> bool:
    """Whether `path` lies inside ssdlocal's cache or the Hugging Face hub cache (and is
    not one of them itself)."""
    found = Path(path).expanduser().resolve()
    return any(found != root and found.is_relative_to(root) for root in _roots())


def hub_entry(repo: str) -> CacheEntry | None:
    """A model repository's folder in the hub cache (every commit of it), if there."""
    from ssdlocal.weights.hub import hf_cache_dir

    folder = hf_cache_dir() / f"models--{repo.replace('/', '--')}"
    return CacheEntry(HUB[0], f"hub/{folder.name}", folder, _size(folder)) if folder.is_dir() else None


def derived(gguf_path: Path, found: list[CacheEntry] | None = None) -> list[CacheEntry]:
    """What ssdlocal built from a GGUF file (its metadata, quantized and converted caches):
    entries named by the file's stem and content key."""
    stem = Path(gguf_path).name.removesuffix(".gguf") + "-"
    kinds = ("metadata", "quantized", "converted")
    named = [e for e in (found if found is not None else entries()) if e.kind in kinds and e.path.name.startswith(stem)]
    if not named:
        return []
    from ssdlocal.weights.formats.metadata import content_key

    key = content_key(Path(gguf_path))[:16]
    return [e for e in named if e.path.name.endswith(key)]


def remove_hub_file(path: Path) -> int:
    """Remove one downloaded file of the hub cache (its snapshot link and the blob it
    points to) and what was built from it; the bytes freed."""
    path = Path(path)
    if not inside_caches(path):
        raise UsageError(f"{path} is not in a cache", "ssdlocal removes only what it downloaded or built")
    freed = 0
    for entry in derived(path) if path.suffix == ".gguf" else []:
        remove(entry)
        freed += entry.size
    blob = path.resolve() if path.is_symlink() else None
    freed += path.resolve().stat().st_size if path.exists() else 0
    path.unlink(missing_ok=True)
    if blob is not None and inside_caches(blob):
        blob.unlink(missing_ok=True)
    return freed


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Every entry of the cache, by kind (in KINDS' order) and name; an index folder is
    one entry."""
    root = root or cache_dir()
    found = []
    for folder, (kind, _) in KINDS.items():
        base = root / folder
        if not base.is_dir():
            continue
        if kind == "index":
            found.append(CacheEntry(kind, f"{folder}/", base, _size(base)))
            continue
        for item in sorted(base.iterdir()):
            if not _is_side_file(item):
                found.append(CacheEntry(kind, f"{folder}/{item.name}", item, _size(item)))
    return found


def _is_side_file(item: Path) -> bool:
    """Locks, verification markers, digest memos, half-built or half-removed leftovers."""
    name = item.name
    return name.endswith(_SIDE_FILES) or name.startswith("digests.json") or ".tmp-" in name or ".removing-" in name


def total_size(found: list[CacheEntry]) -> int:
    return sum(e.size for e in found)


def select(found: list[CacheEntry], words: list[str]) -> list[CacheEntry]:
    """Entries named by `words`: a kind (`converted`), an entry's name or its last part,
    or a prefix of one that names a single entry. UsageError for a word naming nothing."""
    chosen: list[CacheEntry] = []
    for word in words:
        word = word.rstrip("/")
        hits = [e for e in found if e.kind == word]
        hits = hits or [e for e in found if word in (e.name.rstrip("/"), e.path.name)]
        if not hits:
            prefix = [e for e in found if e.path.name.startswith(word) or e.name.startswith(word)]
            if len(prefix) > 1:
                raise UsageError(
                    f"{word!r} names {len(prefix)} cache entries", "give more of the name (see `ssdlocal cache`)"
                )
            hits = prefix
        if not hits:
            kinds = ", ".join(dict.fromkeys(kind for kind, _ in KINDS.values()))
            raise UsageError(
                f"nothing in the cache is called {word!r}", f"`ssdlocal cache` lists the entries; kinds: {kinds}"
            )
        chosen += [e for e in hits if e not in chosen]
    return chosen


def remove(entry: CacheEntry) -> None:
    """Delete one entry unless a process is building it right now (AssetError then); an
    entry outside the caches is refused (UsageError)."""
    path = entry.path
    if not inside_caches(path):
        raise UsageError(f"{path} is not in a cache", "ssdlocal removes only what it downloaded or built")
    lock = path.with_name(path.name + ".lock")
    with _try_lock(lock, entry):
        if not path.exists():
            return
        hidden = path.with_name(f"{path.name}.removing-{os.getpid()}")
        os.replace(path, hidden)  # out of sight at once: no reader trusts a half-deleted entry
        if hidden.is_dir():
            shutil.rmtree(hidden, ignore_errors=True)
        else:
            hidden.unlink(missing_ok=True)
        for suffix in _SIDE_FILES:
            if suffix != ".lock":
                path.with_name(path.name + suffix).unlink(missing_ok=True)
    lock.unlink(missing_ok=True)


@contextlib.contextmanager
def _try_lock(lock: Path, entry: CacheEntry):
    """Hold the entry's build lock if nobody else does (builders hold it while writing)."""
    if not lock.exists():
        yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        yield
        return
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AssetError(
                f"{entry.name} is being built by another ssdlocal process right now",
                "wait for it to finish (or stop it), then remove it",
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def gguf_source(path: str | None) -> str | None:
    """The GGUF file a model path came from, when known: the path itself (.gguf), or the
    source of a cached conversion (float or quantized) whose file is still on disk."""
    if not path:
        return None
    found = Path(path).expanduser()
    if found.is_file() and found.suffix.lower() == ".gguf":
        return str(found)
    for marker in ("quantization.json", "ssdlocal-convert.json"):
        try:
            info = json.loads((found / marker).read_text())
        except (OSError, ValueError):
            continue
        for candidate in (info.get("path"), cache_dir() / "gguf" / str(info.get("source", ""))):
            if candidate and Path(candidate).is_file() and str(candidate).endswith(".gguf"):
                return str(candidate)
    return None
