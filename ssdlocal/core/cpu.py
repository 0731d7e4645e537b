"""This CPU's model name and instruction-set flags, read from the operating system (no torch, no
native library), and which of torch's CPU kernel levels they can run.

torch takes `ATEN_CPU_CAPABILITY=avx512` at its word: on a CPU without AVX-512 the
process dies with SIGILL at its first vector kernel. Anything that pins a level (tests,
scripts, a child process) asks `runs_torch_level` first.
"""

from __future__ import annotations

import functools
import platform

# What ATen checks before it picks a level on its own (aten/src/ATen/native/DispatchStub.cpp).
_TORCH_LEVELS = {
    "avx512": frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"}),
    "avx2": frozenset({"avx2", "fma"}),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags from /proc/cpuinfo (`flags` on x86, `Features` on ARM);
    empty where the operating system does not say (not Linux, or unreadable)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The first CPU's model name from /proc/cpuinfo (`model name` on x86, `Hardware` or
    `cpu model` elsewhere); the platform's processor string where the OS does not say."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor()


def runs_torch_level(level: str) -> bool | None:
    """Whether this CPU can run torch's kernels of `level` ("avx512", "avx2", "default"):
    True or False from the flags, None when the flags are unknown or the level is not one
    this module knows. "default" (plain C++ kernels) runs everywhere."""
    level = level.lower()
    if level == "default":
        return True
    needs = _TORCH_LEVELS.get(level)
    flags = cpu_flags()
    if needs is None or not flags or platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    return needs <= flags


def flags_summary() -> str:
    """Architecture and flags in one sorted line: the identity of what kernels can run here."""
    flags = " ".join(sorted(cpu_flags()))
    return f"{platform.machine()} {flags or platform.processor()}".strip()


__all__ = ["cpu_flags", "cpu_model", "flags_summary", "runs_torch_level"]
