"""llama.cpp's CPU kernels for the default command: llama-cpp-python built once, on the
first CPU run that would use it, as a step of the first run with a progress bar.

`ensure_llamacpp(want)` is called before the backend is chosen. When the run would pick
llama.cpp (`want`: a GGUF target on a CPU-only machine, backends `auto`) and
llama-cpp-python is missing, it checks for a C and a C++ compiler, says what it builds and
about how long that takes on this many cores, then runs `pip install --verbose
llama-cpp-python==<tested>` in this interpreter and turns the build's `[n/m]` (ninja) or
`[ NN%]` (make) lines into a bar. The crash probe (backends/llamacpp/probe.py) still
decides afterwards whether the build is used. `SSDLOCAL_BUILD_LLAMACPP=0` (or
`--target-backend torch`) skips all this and the run uses the torch kernels. Knows nothing
of models or engines.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.progress import ProgressCallback

TESTED_VERSION = "0.3.36"  # the llama-cpp-python release the backend and its probe are tested on
REQUIREMENT = f"llama-cpp-python=={TESTED_VERSION}"
OPT_OUT_ENV = "SSDLOCAL_BUILD_LLAMACPP"  # "0": never build; the torch kernels run instead
# CPU seconds one build of TESTED_VERSION took (704 s user + 55 s sys, 2-core EPYC; see
# docs/benchmarks.md); the estimate divides it by the cores the build may use
BUILD_CPU_S = 760.0
STAGE = f"building llama-cpp-python {TESTED_VERSION} (native code, once)"
_STEP = re.compile(r"^\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]")  # ninja: [12/140] Building C object ...
_PERCENT = re.compile(r"^\s*\[\s*(\d{1,3})%\s*\]")  # make: [ 45%] Building CXX object ...
_TORCH_HINT = f"or go on with the torch kernels: {OPT_OUT_ENV}=0 (or --target-backend torch)"


@dataclass(frozen=True)
class Toolchain:
    """What a source build of llama-cpp-python needs from the machine, as found on PATH
    (None: missing). cmake and ninja are optional: pip fetches them from PyPI when absent."""

    c: str | None
    cxx: str | None
    cmake: str | None

    def missing(self) -> list[str]:
        return [name for name, path in (("C compiler", self.c), ("C++ compiler", self.cxx)) if not path]


def find_toolchain(which: Callable[[str], str | None] | None = None, env: Mapping[str, str] | None = None) -> Toolchain:
    """The compilers CMake would use ($CC / $CXX first, then the usual names) and cmake."""
    which = which or shutil.which
    env = os.environ if env is None else env

    def first(names: Iterable[str]) -> str | None:
        return next((found for name in names if name and (found := which(name))), None)

    return Toolchain(
        c=first((env.get("CC", "").split(" ")[0], "cc", "gcc", "clang")),
        cxx=first((env.get("CXX", "").split(" ")[0], "c++", "g++", "clang++")),
        cmake=first(("cmake",)),
    )


def opted_out(env: Mapping[str, str] | None = None) -> bool:
    """Whether SSDLOCAL_BUILD_LLAMACPP says never to build (0 / no / off / false)."""
    env = os.environ if env is None else env
    return env.get(OPT_OUT_ENV, "").strip().lower() in ("0", "no", "off", "false")


def build_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from one line of the build's output: `[12/140] ...` (ninja) -> (12,
    140), `[ 45%] ...` (make) -> (45, 100); None for any other line."""
    if found := _STEP.match(line):
        done, total = int(found[1]), int(found[2])
        return (done, total) if 0 < total and done <= total else None
    if found := _PERCENT.match(line):
        percent = int(found[1])
        return (percent, 100) if percent <= 100 else None
    return None


def build_cores() -> int:
    """The cores a build may use: this process's CPU affinity, or the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def announcement(cores: int, toolchain: Toolchain) -> str:
    """The line said before the build: what, why, how long here, how to skip it."""
    minutes = BUILD_CPU_S / cores / 60
    cmake = "" if toolchain.cmake else "; pip also fetches cmake, which is not installed here"
    return (
        f"llama.cpp's CPU kernels: building llama-cpp-python {TESTED_VERSION} from source, once "
        f"(native code, about {BUILD_CPU_S / 60:.0f} CPU-minutes: ~{minutes:.0f} min on this "
        f"machine's {cores} core{'s' * (cores != 1)}{cmake}). pip keeps the built wheel, so later "
        f"installs take seconds; {OPT_OUT_ENV}=0 or --target-backend torch skips it."
    )


def ensure_llamacpp(
    want: bool,
    progress: ProgressCallback,
    say: Callable[[str], None],
    *,
    installed: Callable[[], bool] | None = None,
    toolchain: Toolchain | None = None,
    popen=None,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Build and install llama-cpp-python when this run would use llama.cpp and it is
    missing. Returns True when it built it now. `want`: the run would choose llama.cpp were
    it installed. Raises ModelLoadError (message + hint) when a compiler is missing or the
    build fails; nothing happens when opted out, not wanted, or already installed.
    `installed`, `toolchain`, `popen` and `env` stand in for the machine in tests."""
    env = os.environ if env is None else env
    if installed is None:
        from ssdlocal.backends.llamacpp.probe import installed
    if not want or opted_out(env) or installed():
        return False
    toolchain = toolchain or find_toolchain(env=env)
    if missing := toolchain.missing():
        raise ModelLoadError(
            f"llama.cpp's CPU kernels (llama-cpp-python, the fastest CPU backend here) are built "
            f"from source on the first run, and this machine has no {' and no '.join(missing)} on PATH",
            "install a compiler and cmake (Debian/Ubuntu: sudo apt install build-essential cmake; "
            "Fedora: sudo dnf install gcc-c++ cmake; macOS: xcode-select --install), " + _TORCH_HINT,
        )
    from ssdlocal.core.files import file_lock
    from ssdlocal.core.paths import cache_dir

    with file_lock(cache_dir() / "llamacpp-build.lock"):  # two first runs at once build once
        importlib.invalidate_caches()
        if installed():
            return False
        say(announcement(build_cores(), toolchain))
        _pip_install(progress, popen or subprocess.Popen, env)
        importlib.invalidate_caches()
    return True


def _pip_install(progress: ProgressCallback, popen, env: Mapping[str, str]) -> None:
    """`pip install --verbose REQUIREMENT` in this interpreter, its build lines as progress."""
    cmd = [sys.executable, "-m", "pip", "install", "--verbose", REQUIREMENT]
    child_env = {**env, "CMAKE_BUILD_PARALLEL_LEVEL": env.get("CMAKE_BUILD_PARALLEL_LEVEL", str(build_cores()))}
    tail: deque[str] = deque(maxlen=12)  # what pip said last: the error's detail
    started = time.monotonic()
    progress(STAGE, 0, None)
    try:
        proc = popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=child_env,
            start_new_session=True,
        )
    except OSError as exc:
        raise ModelLoadError(
            f"could not run pip to build llama-cpp-python: {exc}", f"pip install {REQUIREMENT}, " + _TORCH_HINT
        ) from exc
    try:
        last = None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if (step := build_progress(line)) is not None:
                last = step
                progress(STAGE, *step)
        code = proc.wait()
    except BaseException:  # Ctrl-C: stop pip and the compilers it started, leave nothing running
        _stop(proc)
        raise
    if code != 0:
        said = " | ".join(line.strip() for line in tail if line.strip())[-600:]
        raise ModelLoadError(
            f"building llama-cpp-python {TESTED_VERSION} failed (pip exit code {code} after "
            f"{time.monotonic() - started:.0f} s): {said}",
            f"run `{sys.executable} -m pip install --verbose {REQUIREMENT}` to see the whole build, " + _TORCH_HINT,
        )
    if last is not None:
        progress(STAGE, last[1], last[1])
    else:  # installed from pip's wheel cache: no build lines
        progress(STAGE, 1, 1)


def _stop(proc) -> None:
    """Kill the build's whole process group (pip, cmake, ninja, the compilers), then reap pip."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # no group of its own (or gone already): pip alone
        proc.kill()
    proc.wait()
