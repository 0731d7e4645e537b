"""What a pair file (`models/pairs/*.toml`) may hold: each table's keys and the kind of value
each takes, the words a draft without a model may be, the draft head kinds a `[draft]` may
name, and the error every mistake becomes (a UsageError naming the file and the key).
Reading a file into a Pair is weights/pairs.py; this module knows only the keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import BackendName
from ssdlocal.weights.formats.archs import HEADS

SOURCES = ("hf", "pypi", "local")
WEIGHTS = ("safetensors", "gguf")  # hf pairs: what the repos hold (gguf: every backend reads the GGUF files)
DRAFT_WORDS = ("suffix", "ngram")  # `draft = "suffix"`: a pair whose draft is no model
MAX_SUGGESTED_K = 32
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


@dataclass(frozen=True)
class _Kind:
    """What one key's value must be: a test and the words for it in an error."""

    ok: Callable[[object], bool]
    words: str


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


_STR = _Kind(lambda v: isinstance(v, str) and v != "", "a non-empty string")
_TEXT = _Kind(lambda v: isinstance(v, str), "a string")
_BOOL = _Kind(lambda v: isinstance(v, bool), "true or false (unquoted)")
_GB = _Kind(_number, "a number >= 0")
_COUNT = _Kind(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1")
_REPO = _Kind(
    lambda v: isinstance(v, str) and bool(_REPO_ID.match(v)) and ".." not in v and "--" not in v,
    'a hub repo id "owner/name"',
)
_GLOBS = _Kind(
    lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
    'a list of glob strings, e.g. ["*.json", "*.safetensors"]',
)
_TABLE = _Kind(lambda v: isinstance(v, dict), "a table")
_DRAFT = _Kind(
    lambda v: isinstance(v, dict) or v in DRAFT_WORDS,
    f"a table, or one of {', '.join(map(repr, DRAFT_WORDS))} (a draft without a model)",
)
_WEIGHTS = _Kind(lambda v: v in WEIGHTS, " or ".join(map(repr, WEIGHTS)))
_FAN = _Kind(
    lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
    "a list of integers >= 0",
)

TOP_KEYS = {
    "name": _STR,
    "description": _TEXT,
    "family": _TEXT,
    "source": _STR,
    "weights": _WEIGHTS,
    "gated": _BOOL,
    "suggested_k": _COUNT,
    "suggested_fan_out": _FAN,
    "target": _TABLE,
    "draft": _DRAFT,
    "torch": _TABLE,
    "llamacpp": _TABLE,
    "backends": _Kind(
        lambda v: isinstance(v, list) and bool(v) and all(x in BackendName.choices() for x in v),
        f"a non-empty list of backend names ({', '.join(BackendName.choices())})",
    ),
}
MODEL_KEYS = {
    "repo": _REPO,
    "revision": _STR,
    "asset": _STR,
    "path": _STR,
    "params_b": _GB,
    "active_params_b": _GB,
    "experts": _COUNT,
    "experts_per_token": _COUNT,
    "bf16_gb": _GB,
    "embed_b": _GB,
    "whole_b": _GB,
    "heads": _COUNT,
    "kv_heads": _COUNT,
    "layers": _COUNT,
    "head_dim": _COUNT,
    # a draft head (weights.formats.archs.HEADS): it drafts from the target's hidden states
    "head": _Kind(lambda v: v in HEADS, f"a draft head kind ({', '.join(map(repr, HEADS))})"),
}
FILE_KEYS = {
    "repo": _REPO,
    "revision": _STR,
    "filename": _STR,
    "asset": _STR,
    "path": _STR,
    "quant": _TEXT,
    "size_gb": _GB,
}
TORCH_KEYS = {"allow_patterns": _GLOBS, "ignore_patterns": _GLOBS}
LLAMACPP_KEYS = {"target": _TABLE, "draft": _TABLE}


def bad(path: Path, what: str) -> UsageError:
    return UsageError(
        f"pair file {path}: {what}",
        "see models/pairs/*.toml in the ssdlocal sources for the format",
    )


def check(table: dict, schema: dict[str, _Kind], where: str, path: Path, *, kinds: bool = True) -> dict:
    """Every key known and (with `kinds`) every value of the right kind; `where` names the
    table ("" = the top level)."""
    unknown = set(table) - set(schema)
    if unknown:
        inside = f"[{where}] has" if where else "has"
        raise bad(path, f"{inside} unknown keys {sorted(unknown)} (known: {', '.join(schema)})")
    for key, value in table.items() if kinds else ():
        if not schema[key].ok(value):
            name = f"{where}.{key}" if where else key
            raise bad(path, f"`{name}` must be {schema[key].words}, got {value!r}")
    return table
