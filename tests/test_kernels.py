"""The first CPU run builds llama-cpp-python once (cli/kernels.py), with fakes: no compiler,
no pip and no native build run here.

Checked: a missing compiler is `error:` + `hint:` before anything runs (and before any
download, on the CLI); the build's `[n/m]` / `[ NN%]` lines become a progress bar; the
pinned, verbose pip command; a failed build's error carries pip's last words; the opt-out
(SSDLOCAL_BUILD_LLAMACPP=0, --target-backend torch, int8/int4, a GPU) builds nothing; and
a freshly built llama.cpp still has to pass the crash probe before `auto` uses it.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from support.cli import assert_clean_error, run_cli
from ssdlocal.cli import kernels
from ssdlocal.cli.kernels import Toolchain, build_progress, ensure_llamacpp
from ssdlocal.core.errors import ModelLoadError

FAKE = Path(__file__).resolve().parent / "support" / "fake_llama_cpp"
FULL = Toolchain("/usr/bin/cc", "/usr/bin/c++", "/usr/bin/cmake")

NINJA = """Collecting llama-cpp-python==0.3.36
  Running command Building wheel for llama-cpp-python (pyproject.toml)
  *** Configuring CMake...
  [1/4] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
  [2/4] Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama.cpp.o
  [4/4] Linking CXX shared library vendor/llama.cpp/src/libllama.so
Successfully installed llama-cpp-python-0.3.36
"""


class FakePip:
    """Stands in for subprocess.Popen: prints `output`, exits with `code`, records the call."""

    def __init__(self, output: str = NINJA, code: int = 0, then=None) -> None:
        self.output, self.code, self.then, self.calls = output, code, then, []

    def __call__(self, cmd, **kwargs):
        self.calls.append((cmd, kwargs))
        fake = self

        class Proc:
            stdout = io.StringIO(fake.output)

            def wait(self):
                if fake.then is not None:
                    fake.then()
                return fake.code

            def kill(self):
                pass

        return Proc()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))  # the build's lock file


def _run(pip=None, *, installed=False, toolchain=FULL, env=None, want=True):
    seen, said = [], []
    built = ensure_llamacpp(
        want,
        lambda *a: seen.append(a),
        said.append,
        installed=lambda: installed,
        toolchain=toolchain,
        popen=pip,
        env={} if env is None else env,
    )
    return built, seen, said


@pytest.mark.parametrize(
    ("line", "step"),
    [
        ("[12/140] Building C object ggml.c.o", (12, 140)),
        ("  [ 45%] Building CXX object x.o", (45, 100)),
        ("[100%] Linking CXX shared library libllama.so", (100, 100)),
        ("[3/3] Linking", (3, 3)),
        ("Building wheel for llama-cpp-python (pyproject.toml)", None),
        ("[0/0] nothing", None),
        ("[9/4] corrupt", None),
        ("[250%] corrupt", None),
        ("-- [ok] cmake check", None),
    ],
)
def test_build_lines_become_progress(line, step):
    assert build_progress(line) == step


@pytest.mark.parametrize("missing", [("c",), ("cxx",), ("c", "cxx")])
def test_a_missing_compiler_is_an_error_with_a_hint(missing):
    pip = FakePip()
    toolchain = Toolchain(**{"c": "/usr/bin/cc", "cxx": "/usr/bin/c++", "cmake": None} | dict.fromkeys(missing))
    with pytest.raises(ModelLoadError) as info:
        _run(pip, toolchain=toolchain)
    names = {"c": "C compiler", "cxx": "C++ compiler"}
    assert all(f"no {names[m]}" in info.value.message for m in missing), info.value.message
    hint = info.value.hint
    assert "build-essential" in hint and "SSDLOCAL_BUILD_LLAMACPP=0" in hint and "--target-backend torch" in hint
    assert pip.calls == []  # nothing ran


def test_the_toolchain_is_found_on_path_cc_first():
    paths = {"clang": "/usr/bin/clang", "g++": "/usr/bin/g++", "mycc": "/opt/mycc"}
    found = kernels.find_toolchain(paths.get, env={"CC": "mycc -O2"})
    assert found == Toolchain("/opt/mycc", "/usr/bin/g++", None) and found.missing() == []
    assert kernels.find_toolchain(lambda name: None, env={}).missing() == ["C compiler", "C++ compiler"]


def test_the_build_runs_pinned_pip_verbosely_and_shows_progress():
    pip = FakePip()
    built, seen, said = _run(pip)
    assert built
    ((cmd, kwargs),) = pip.calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "--verbose" in cmd
    assert cmd[-1] == f"llama-cpp-python=={kernels.TESTED_VERSION}"
    assert kwargs["env"]["CMAKE_BUILD_PARALLEL_LEVEL"] == str(kernels.build_cores())
    assert seen == [
        (kernels.STAGE, 0, None),
        (kernels.STAGE, 1, 4),
        (kernels.STAGE, 2, 4),
        (kernels.STAGE, 4, 4),
        (kernels.STAGE, 4, 4),
    ]
    (line,) = said  # what, how long on this many cores, the wheel cache, the opt-out
    assert "from source" in line and f"{kernels.build_cores()} core" in line
    assert "wheel" in line and "SSDLOCAL_BUILD_LLAMACPP=0" in line


def test_the_estimate_scales_with_cores():
    two, eight = (kernels.announcement(n, FULL) for n in (2, 8))
    minutes = lambda text: int(text.split("~")[1].split(" ")[0])  # noqa: E731
    assert minutes(two) == round(kernels.BUILD_CPU_S / 2 / 60) and minutes(eight) < minutes(two)
    assert "fetches cmake" in kernels.announcement(2, Toolchain("cc", "c++", None))


def test_a_cached_wheel_finishes_the_bar():
    """pip's wheel cache installs without build lines: the bar still ends done."""
    _, seen, _ = _run(FakePip("Using cached llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl\n"))
    assert seen[-1] == (kernels.STAGE, 1, 1)


def test_a_failed_build_says_what_pip_said():
    output = NINJA.replace("Successfully installed llama-cpp-python-0.3.36", "FAILED: ggml.c.o\nninja: build stopped")
    with pytest.raises(ModelLoadError) as info:
        _run(FakePip(output, code=1))
    assert "failed (pip exit code 1" in info.value.message and "ninja: build stopped" in info.value.message
    assert "--verbose" in info.value.hint and "SSDLOCAL_BUILD_LLAMACPP=0" in info.value.hint


def test_an_interrupted_build_stops_pip_and_its_compilers(monkeypatch):
    """Ctrl-C while the build runs: the whole process group pip started is killed, then the
    interrupt goes on."""
    killed = []

    class Lines:
        def __iter__(self):
            yield "[1/4] Building C object ggml.c.o\n"
            raise KeyboardInterrupt

    class Proc:
        pid = 4242
        stdout = Lines()

        def wait(self):
            return -9

        def kill(self):
            killed.append("pip")

    monkeypatch.setattr(kernels.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    calls = []
    with pytest.raises(KeyboardInterrupt):
        _run(lambda cmd, **kwargs: calls.append(kwargs) or Proc())
    assert killed == [(4242, kernels.signal.SIGKILL)] and calls[0]["start_new_session"]


def test_a_run_that_waited_for_another_runs_build_builds_nothing():
    """Two first runs at once: the second takes the lock after the first built it."""
    answers = iter([False, True])  # before the lock, after it
    pip = FakePip()
    built = ensure_llamacpp(
        True, lambda *a: None, lambda line: None, installed=lambda: next(answers), toolchain=FULL, popen=pip, env={}
    )
    assert not built and pip.calls == []


@pytest.mark.parametrize("case", ["opted out", "installed", "not wanted"])
def test_nothing_is_built_when_not_needed(case):
    pip = FakePip()
    built, seen, said = _run(
        pip,
        installed=case == "installed",
        want=case != "not wanted",
        toolchain=Toolchain(None, None, None),  # would be an error if it ran
        env={"SSDLOCAL_BUILD_LLAMACPP": "0"} if case == "opted out" else {},
    )
    assert (built, seen, said, pip.calls) == (False, [], [], [])


# --------------------------------------------------------------------------- on the CLI
def _cpu_only(monkeypatch):
    from ssdlocal.placement.inventory import DeviceInventory

    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: DeviceInventory((), 2, 8.0))


@pytest.fixture
def first_cpu_run(monkeypatch, tmp_path):
    """The default command on a CPU-only machine without llama-cpp-python and with the
    build allowed; downloads fail the test (every check here comes before them)."""
    from ssdlocal.weights import assets

    _cpu_only(monkeypatch)
    monkeypatch.delenv("SSDLOCAL_BUILD_LLAMACPP", raising=False)
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: False)
    monkeypatch.setattr(assets, "fetch_gguf", lambda *a, **k: pytest.fail("downloaded"))
    return tmp_path


def test_cli_without_a_compiler_fails_before_any_download(first_cpu_run, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "find_toolchain", lambda **k: Toolchain(None, None, "/usr/bin/cmake"))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "hi", "--max-new-tokens", "2")
    assert_clean_error(code, err, 1, "no C compiler and no C++ compiler", "SSDLOCAL_BUILD_LLAMACPP=0")
    assert out == ""


@pytest.mark.parametrize(
    "args", [("--target-backend", "torch"), ("--quantization", "int4"), ("--target-device", "cuda:0")]
)
def test_cli_choices_that_skip_the_build(first_cpu_run, monkeypatch, args):
    from ssdlocal.cli.options import ModelOptions
    from ssdlocal.cli.resolve import _build_kernels

    monkeypatch.setattr(kernels, "_pip_install", lambda *a: pytest.fail("built"))
    flags = {"--target-backend": "target_backend", "--quantization": "quantization", "--target-device": "target_device"}
    _build_kernels(ModelOptions(**{flags[args[0]]: args[1]}), ())
    monkeypatch.setenv("SSDLOCAL_BUILD_LLAMACPP", "0")
    _build_kernels(ModelOptions(), ())


def test_a_fresh_build_still_faces_the_crash_probe(first_cpu_run, monkeypatch):
    """The build 'installs' a llama.cpp that dies of SIGSEGV on its first evaluation: the
    probe catches it in a child and `auto` runs on torch, saying why."""
    from ssdlocal.cli.options import ModelOptions
    from ssdlocal.cli.resolve import _build_kernels, backend_choice

    state = {"installed": False}

    def install(progress, popen, env):  # what pip leaves behind: an importable llama_cpp
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("FAKE_LLAMA_CPP", "segv")
        monkeypatch.setenv("FAKE_LLAMA_CPP_LOG", str(first_cpu_run / "loads.log"))
        monkeypatch.syspath_prepend(str(FAKE))
        monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
        state["installed"] = True

    monkeypatch.setattr(kernels, "find_toolchain", lambda **k: FULL)
    monkeypatch.setattr(kernels, "_pip_install", install)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: state["installed"])
    _build_kernels(ModelOptions(), ())
    assert state["installed"]
    choice = backend_choice(ModelOptions())
    assert (choice.target, choice.draft) == ("torch", "torch")
    assert choice.note.startswith("backend torch: ") and "SIGSEGV" in choice.note
    sys.modules.pop("llama_cpp", None)
