"""Measurements of this machine kept across runs (the start-up calibration's step costs,
the prefill path's timings), so a later start with the same models reads them instead of
timing forwards again.

Each measurement is one small JSON file in the cache's `calibration/` folder, named by the
digest of its key. A key holds everything the numbers depend on: what was measured, this
machine (`machine()`: CPU model and instruction-set flags, usable cores, torch version,
intra-op threads), and what the caller adds (model files by `file_stamps`: resolved path,
size and mtime of each file; backend, dtype, quantization). A change in any of them is
another key, so it is measured again. A file is trusted only when it is a small regular
file that parses, carries this FORMAT and exactly the key asked for, and whose value
passes the caller's check (e.g. finite positive seconds): anything else - damaged,
edited, from another machine or version - is ignored, measured again and overwritten.
The numbers only steer speed decisions (mode, K, prefill path), never what is generated.
Writes are atomic and never fail the caller. Knows nothing of models or engines.
`SSDLOCAL_KEEP_MEASUREMENTS=0` measures at every start and keeps nothing (benchmarks on a
machine whose load changes; the test suite).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FOLDER = "calibration"
FORMAT = 2  # 2: llama.cpp contexts on a CPU run without flash attention (step costs changed)
MAX_BYTES = 64 * 1024  # a measurement is a few hundred bytes; anything larger is not ours
MAX_FILES = 64  # the oldest go first (models replaced, machines changed)


def machine() -> dict[str, Any]:
    """What this process's timings depend on besides the models: the CPU (model, flags,
    architecture), the cores it may use, torch's version and intra-op threads."""
    import torch

    from ssdlocal.core.cpu import cpu_flags, cpu_model

    model, flags = cpu_model(), " ".join(sorted(cpu_flags()))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return {
        "arch": platform.machine(),
        "cpu": model,
        "flags": flags,
        "cores": cores,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def file_stamps(path: str | Path) -> list:
    """[resolved path, [[name, size, mtime_ns], ...]] of a model: the file itself, or the
    files directly in its directory (weights, config, tokenizer)."""
    root = Path(path).expanduser().resolve()
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else []
    stamps = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        stamps.append([f.name, st.st_size, st.st_mtime_ns])
    return [str(root), stamps]


def positive_seconds(value: Any, count: int | None = None) -> bool:
    """A list of finite seconds in (0, 600] (of `count` items when given): the check a
    timing must pass before it is trusted."""
    if not isinstance(value, list) or (count is not None and len(value) != count) or not value:
        return False
    return all(type(v) in (int, float) and math.isfinite(v) and 0 < v <= 600 for v in value)


def keeping() -> bool:
    """False when `SSDLOCAL_KEEP_MEASUREMENTS` is 0/false/no/off: nothing read or kept."""
    return os.environ.get("SSDLOCAL_KEEP_MEASUREMENTS", "1").strip().lower() not in ("0", "false", "no", "off")


class MeasuredStore:
    """Measurements by key under `directory` (default: the cache's calibration folder);
    with `keeping()` false, `get` finds nothing and `put` keeps nothing."""

    def __init__(self, directory: Path | None = None) -> None:
        if directory is None:
            from ssdlocal.core.paths import cache_dir

            directory = cache_dir() / FOLDER
        self.directory = Path(directory)

    @staticmethod
    def full_key(kind: str, key: dict) -> dict:
        return {"format": FORMAT, "kind": kind, "machine": machine(), **key}

    def path(self, full_key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:20]
        return self.directory / f"{full_key['kind']}-{digest}.json"

    def get(self, kind: str, key: dict, check: Callable[[Any], bool]) -> Any | None:
        """The value stored for this key on this machine, or None (missing or not trusted)."""
        if not keeping():
            return None
        full = self.full_key(kind, key)
        path = self.path(full)
        try:
            if not path.is_file() or path.stat().st_size > MAX_BYTES:
                return None
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            log.info("ignoring the unreadable measurement %s: measuring again", path)
            return None
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(full, sort_keys=True)):
            log.info("ignoring the measurement %s: made for something else", path)
            return None
        value = data.get("value")
        try:
            trusted = check(value)
        except (TypeError, ValueError, KeyError):
            trusted = False
        if not trusted:
            log.info("ignoring the measurement %s: its values are not plausible timings", path)
            return None
        return value

    def put(self, kind: str, key: dict, value: Any) -> None:
        """Keep `value` for this key (atomically; a failure to write is only logged)."""
        if not keeping():
            return
        full = self.full_key(kind, key)
        path = self.path(full)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": full, "value": value, "measured_at": time.time()}, sort_keys=True))
            os.replace(tmp, path)
            self._prune(keep=path)
        except (OSError, TypeError, ValueError) as exc:
            log.info("could not keep the measurement in %s: %s (measured again next start)", path, exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def _prune(self, keep: Path) -> None:
        """At most MAX_FILES measurements: the least recently written go."""
        files = [p for p in self.directory.glob("*.json") if p != keep]
        if len(files) < MAX_FILES:
            return
        files.sort(key=lambda p: p.stat().st_mtime_ns if p.exists() else 0)
        for old in files[: len(files) + 1 - MAX_FILES]:
            old.unlink(missing_ok=True)


def kept(directory: Path | None = None) -> list[dict]:
    """The measurements kept for this machine (any models), newest first: each file's
    kind, models it names, and when it was made. For `ssdlocal devices`."""
    store = MeasuredStore(directory)
    here = machine()
    found = []
    try:
        files = sorted(store.directory.glob("*.json"))
    except OSError:
        return []
    for path in files:
        try:
            if path.stat().st_size > MAX_BYTES:
                continue
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        key = data.get("key") if isinstance(data, dict) else None
        if not isinstance(key, dict) or key.get("format") != FORMAT or key.get("machine") != here:
            continue
        models = [m[0] for m in key.get("models", []) if isinstance(m, list) and m and isinstance(m[0], str)]
        when = data.get("measured_at")
        found.append(
            {
                "kind": key.get("kind"),
                "models": models,
                "path": str(path),
                "measured_at": when if isinstance(when, (int, float)) else None,
            }
        )
    return sorted(found, key=lambda e: e["measured_at"] or 0, reverse=True)
