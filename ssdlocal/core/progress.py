"""Progress of long steps (download, conversion, quantization, loading, calibration), from
the code doing the work to whoever shows it.

A step reports `progress(stage, done, total)` to the callback it was handed, or, without
one, to the display installed with `showing()` (the CLI's bars, the TUI's loading line);
with neither, nothing happens. `stage` is what people read ("quantizing to int4: <model>");
its first word says what is counted (`unit_of`). Displays may be called from any thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# progress(stage, done, total): total is None when unknown
ProgressCallback = Callable[[str, float, "float | None"], None]

# what a stage counts, by its first word
UNITS = {
    "download": "files",
    "assemble": "bytes",
    "checking": "bytes",
    "converting": "tensors",
    "writing": "bytes",
    "quantizing": "bytes",
    "loading": "bytes",
    "reading": "files",
    "calibrating": "steps",
    "starting": "",  # a stage of its own only to say what runs: no count
    "warming": "modes",
    "running": "tokens",
    "comparing": "modes",
}

_displays: list[ProgressCallback] = []
_lock = threading.Lock()


def unit_of(stage: str) -> str:
    """The unit a stage counts in (files, bytes, tensors, steps)."""
    return UNITS.get(stage.split(" ", 1)[0].rstrip(":"), "steps")  # "": nothing counted


@contextlib.contextmanager
def showing(display: ProgressCallback) -> Iterator[ProgressCallback]:
    """Install `display` for steps reported without a callback of their own."""
    with _lock:
        _displays.append(display)
    try:
        yield display
    finally:
        with _lock:
            _displays.remove(display)


def current() -> ProgressCallback | None:
    """The innermost installed display, if any."""
    with _lock:
        return _displays[-1] if _displays else None


def report(stage: str, done: float, total: float | None) -> None:
    """Tell the installed display (if any) how far `stage` is."""
    display = current()
    if display is not None:
        display(stage, done, total)


def reporter(progress: ProgressCallback | None = None) -> ProgressCallback | None:
    """`progress` itself, else the installed display's reporter, else None (report nothing)."""
    if progress is not None:
        return progress
    return report if current() is not None else None


def model_label(path: str | Path) -> str:
    """A short name for a model file or directory in a stage line (one line of an
    80-column terminal): `qwen2.5-coder-1.5b-instruct-q4_k_m.gguf` -> `qwen2.5-coder-1.5b`."""
    name = Path(path).name
    stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    parts = stem.split("-")
    while len(parts) > 1 and parts[-1].lower().startswith(_SUFFIXES):
        parts.pop()  # the file's quantization is said elsewhere, "instruct" adds nothing here
    return "-".join(parts) or name


_SUFFIXES = ("q2", "q3", "q4", "q5", "q6", "q8", "f16", "bf16", "f32", "iq", "instruct")
