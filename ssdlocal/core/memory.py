"""Out-of-memory failures as users see them, and how much RAM is free.

`oom_error` recognises allocator failures (torch's CUDA OutOfMemoryError, the CPU
allocator's "can't allocate memory", "not enough memory") and turns them into one
OutOfMemoryError naming the size asked for and what to shrink. No torch import here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ssdlocal.core.errors import OutOfMemoryError

OOM_HINT = (
    "use a smaller --k or --fan-out, fewer prompts (batch), a shorter prompt or "
    "--max-new-tokens (context), a smaller or quantized model (--dtype bfloat16, a GGUF "
    "through --target-backend llamacpp), or another device"
)
_OOM_TEXT = re.compile(r"out of memory|can't allocate memory|not enough memory|cannot allocate memory", re.IGNORECASE)
_CPU_SIZE = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
_CUDA_SIZE = re.compile(r"tried to allocate ([\d.]+) ([KMGT]i?B)", re.IGNORECASE)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; 3 * 2**30 -> '3.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


def requested_bytes(text: str) -> int | None:
    """The allocation size an allocator's message names, if it names one."""
    if m := _CPU_SIZE.search(text):
        return int(m.group(1))
    if m := _CUDA_SIZE.search(text):
        return int(float(m.group(1)) * _UNITS[m.group(2)[0].upper()])
    return None


def is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or bool(_OOM_TEXT.search(str(exc)))


def oom_error(exc: BaseException, doing: str = "", hint: str = OOM_HINT) -> OutOfMemoryError | None:
    """OutOfMemoryError for an allocator failure (`doing` says what ran out), else None."""
    if isinstance(exc, OutOfMemoryError):
        return exc
    if not is_oom(exc):
        return None
    size = requested_bytes(str(exc))
    where = f" {doing}" if doing else ""
    need = f": an allocation of {human_bytes(size)} failed" if size else ""
    return OutOfMemoryError(f"out of memory{where}{need}", hint)


def available_ram_bytes(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (Linux), None where unknown."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: allocations below it come from the heap


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Let this process reuse the memory it frees instead of returning it to the system
    (glibc only; once per process). A forward allocates and frees the same large
    temporaries layer after layer; by default glibc maps each anew and the kernel zeroes
    every page on first touch, which on a 2-core CPU costs about as much time in a long
    prefill as the matrix products. The price: the process keeps its peak heap. Returns
    whether the setting took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@contextmanager
def allocating(doing: str) -> Iterator[None]:
    """An allocator failure inside (torch's OutOfMemoryError is a RuntimeError) becomes an
    OutOfMemoryError saying what was `doing`; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as exc:
        mapped = oom_error(exc, doing)
        if mapped is None:
            raise
        raise mapped from exc
