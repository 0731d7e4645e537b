"""Whether llama.cpp can be trusted on this machine: probed once in a child process, the
verdict cached per (llama-cpp-python build, CPU flags).

A native library that crashes takes the whole process with it (the user's chat, the
server), so before llama.cpp runs here for the first time a child process
(probe_child.py) loads a tiny model (probe_model.py) and evaluates a few tokens. When it
dies (a signal, an error, or no answer within the timeout), a second child tries again
with CPU weight repacking ("extra buffer types") off, the setting known to avoid such
crashes; if that runs, llama.cpp is used with it off. The verdict is written atomically
to `<cache>/probes/` and trusted only when it parses, carries this build's and CPU's key
and has every field (a damaged file is probed again). Deleting it probes again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import ModelLoadError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'ssdlocal[llamacpp]' (builds llama-cpp-python from source, a few minutes)"
FORMAT = 1  # of the cached verdict; a change re-probes every machine
TIMEOUT_S = 120.0  # per child: python + torch + llama.cpp start-up and a ~1 MB model
_LIB_SUFFIXES = (".so", ".dylib", ".dll")


@dataclass(frozen=True)
class Verdict:
    """What the probe found. `extra_bufts`: llama.cpp may repack weights for this CPU
    (False: only runs with it off). `reason`: one line for the user. `fresh`: probed by
    this call rather than read from the cache."""

    ok: bool
    extra_bufts: bool
    reason: str
    library: str
    path: Path
    fresh: bool = False


def installed() -> bool:
    """Whether `import llama_cpp` would find a package (nothing is imported)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def library_identity() -> dict | None:
    """The installed llama-cpp-python: version, location, and its native files' sizes and
    times (a rebuild with other flags under the same version is another library)."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    package = Path(spec.origin).parent
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    files = [Path(spec.origin)]
    files += sorted(p for p in package.rglob("*") if p.suffix in _LIB_SUFFIXES or ".so." in p.name)
    stamps = []
    for file in files:
        try:
            st = file.stat()
        except OSError:
            continue
        stamps.append([str(file.relative_to(package)), st.st_size, st.st_mtime_ns])
    return {"version": version, "path": str(package), "files": stamps}


def cpu_flags() -> str:
    """This CPU's model-independent identity: architecture and instruction-set flags."""
    from ssdlocal.core.cpu import flags_summary

    return flags_summary()


def probe_key(identity: dict) -> str:
    blob = json.dumps({"format": FORMAT, "library": identity, "cpu": cpu_flags()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def verdict_path(identity: dict, key: str) -> Path:
    from ssdlocal.core.paths import cache_dir

    return cache_dir() / "probes" / f"llamacpp-{identity['version']}-{key[:16]}.json"


def read_verdict(path: Path, key: str) -> Verdict | None:
    """The cached verdict, or None when missing, damaged or for another build or CPU."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fields = ("ok", "extra_bufts", "reason", "library")
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        return None
    if not all(isinstance(data.get(f), t) for f, t in zip(fields, (bool, bool, str, str))):
        return None
    return Verdict(data["ok"], data["extra_bufts"], data["reason"], data["library"], path)


def llamacpp_verdict(timeout_s: float = TIMEOUT_S) -> Verdict:
    """The verdict for the installed llama-cpp-python on this CPU: cached, or probed now
    (under a lock: concurrent first runs probe once). Raises ModelLoadError when
    llama-cpp-python is not installed."""
    from ssdlocal.core.files import atomic_write_text, file_lock

    identity = library_identity()
    if identity is None:
        raise ModelLoadError("the llama.cpp backend needs llama-cpp-python, which is not installed", INSTALL_HINT)
    key = probe_key(identity)
    path = verdict_path(identity, key)
    cached = read_verdict(path, key)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(path.name + ".lock")):
        cached = read_verdict(path, key)
        if cached is not None:
            return cached
        found = run_probe(f"llama-cpp-python {identity['version']}", path, timeout_s)
        record = {
            "format": FORMAT,
            "key": key,
            "ok": found.ok,
            "extra_bufts": found.extra_bufts,
            "reason": found.reason,
            "library": found.library,
            "cpu": cpu_flags(),
        }
        try:
            atomic_write_text(path, json.dumps(record, indent=1) + "\n")
        except OSError as exc:  # a read-only cache: probe again next time
            log.warning("could not save the llama.cpp probe's verdict in %s: %s", path, exc)
    log.info("llama.cpp probe: %s", found.reason)
    return found


def require_llamacpp(timeout_s: float = TIMEOUT_S) -> Verdict:
    """The verdict when llama.cpp runs here; ModelLoadError with a hint when it crashed."""
    found = llamacpp_verdict(timeout_s)
    if not found.ok:
        raise ModelLoadError(
            f"{found.reason}; ssdlocal will not run it in this process",
            "use the torch backend (--target-backend torch / --draft-backend torch; `auto` "
            "picks it on this machine), or reinstall llama-cpp-python built for this CPU "
            "(pip install --force-reinstall --no-cache-dir llama-cpp-python); to test llama.cpp "
            f"again, delete {found.path}",
        )
    return found


def run_probe(library: str, path: Path, timeout_s: float) -> Verdict:
    """Probe in child processes: as the runner loads models, then with repacking off."""
    from ssdlocal.backends.llamacpp.probe_model import write_probe_gguf

    with tempfile.TemporaryDirectory(prefix="ssdlocal-probe-") as tmp:
        model = str(write_probe_gguf(Path(tmp) / "probe.gguf"))
        first = _run_child(model, "on", timeout_s)
        if first is None:
            reason = f"{library} evaluated a tiny model on this CPU"
            return Verdict(True, True, reason, library, path, fresh=True)
        second = _run_child(model, "off", timeout_s)
    if second is None:
        reason = (
            f"{library} failed on this CPU with its CPU weight repacking (extra buffer "
            f"types) on ({first}) and runs with it off, so ssdlocal turns it off"
        )
        return Verdict(True, False, reason, library, path, fresh=True)
    also = "" if second == "unsupported" else f", and with CPU weight repacking off ({second})"
    reason = f"{library} failed a test run on this CPU: {first}{also}"
    return Verdict(False, True, reason, library, path, fresh=True)


def _run_child(model: str, extra_bufts: str, timeout_s: float) -> str | None:
    """None when the child evaluated the model; else what went wrong, in a few words."""
    # the directory holding `ssdlocal`, after the caller's own path (the same llama_cpp)
    root = str(Path(__file__).resolve().parents[3])
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)
    cmd = [sys.executable, "-m", "ssdlocal.backends.llamacpp.probe_child", model, "--extra-bufts", extra_bufts]
    try:
        proc = subprocess.run(
            cmd,
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s:g} s evaluating a tiny model"
    answer = _last_json(proc.stdout)
    if proc.returncode == 0 and answer.get("ok") is True:
        return None
    said = (proc.stderr.strip().splitlines() or [""])[-1][:160]  # e.g. a GGML_ASSERT line
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"{name} evaluating a tiny model" + (f": {said}" if said else "")
    if answer.get("unsupported"):
        return "unsupported"
    detail = answer.get("error") or said or "no output"
    return f"exit code {proc.returncode} evaluating a tiny model: {detail[:200]}"


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return {}
