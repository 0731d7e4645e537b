"""Packaging: all version strings agree; packaging/build.sh builds a wheel and sdist that
hold every module, the pair registry and package data; the installed wheel finds its
pair files through importlib.resources (not the source checkout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import ssdlocal

ROOT = Path(__file__).resolve().parent.parent


def test_version_strings_agree():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ssdlocal.__version__ == version
    found = {}
    for path in sorted((ROOT / "packaging").iterdir()):
        if not path.is_file():
            continue
        text = path.read_text()
        for pattern in (
            r"ssdlocal[-:](\d+\.\d+\.\d+\w*)",
            r'version="(\d+\.\d+\.\d+\w*)"',
            r"^Version (\d+\.\d+\.\d+\w*)",
        ):
            for match in re.finditer(pattern, text, re.MULTILINE):
                found.setdefault(match.group(1), []).append(path.name)
    assert found, "the packaging files should name the version they package"
    assert set(found) == {version}, found


def test_cli_version(monkeypatch, capsys):
    from ssdlocal.cli.app import main

    monkeypatch.setattr(sys, "argv", ["ssdlocal", "--version"])
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().out.strip() == f"ssdlocal {ssdlocal.__version__}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        ["bash", str(ROOT / "packaging" / "build.sh"), str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_ISOLATION": "1", "PYTHON": sys.executable},
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: "), proc.stdout
    return out


def test_wheel_and_sdist_contents(dist):
    wheel = next(dist.glob("ssdlocal-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    pairs = sorted(p.name for p in (ROOT / "models" / "pairs").glob("*.toml"))
    assert len(pairs) >= 9
    assert {f"ssdlocal/_pairs/{p}" for p in pairs} <= names
    assert "ssdlocal/data/prompts.jsonl" in names
    assert not any(n.startswith(("models/", "tests/")) for n in names)
    sys.path.insert(0, str(ROOT / "packaging"))
    try:
        import verify_dist
    finally:
        sys.path.pop(0)
    assert verify_dist.main(str(dist)) == 0


def test_verify_dist_catches_a_missing_pair_file(dist, tmp_path):
    wheel = next(dist.glob("ssdlocal-*.whl"))
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if not item.filename.endswith("qwen3-8b.toml"):
                dst.writestr(item, src.read(item))
    (tmp_path / next(dist.glob("*.tar.gz")).name).write_bytes(next(dist.glob("*.tar.gz")).read_bytes())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "packaging" / "verify_dist.py"), str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "qwen3-8b.toml" in proc.stderr


def test_installed_wheel_finds_its_pairs(dist, tmp_path):
    """Unzip the wheel (a pure-Python install) and import it without site-packages."""
    site = tmp_path / "site"
    zipfile.ZipFile(next(dist.glob("ssdlocal-*.whl"))).extractall(site)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import ssdlocal.weights.pairs as p; "
        "print(p.builtin_dir()); print(len(p.load_pairs())); print(p.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", ""), "SSDLOCAL_CONFIG_DIR": str(tmp_path / "cfg")},
    )
    assert proc.returncode == 0, proc.stderr
    where, count, module = proc.stdout.split()
    assert Path(where) == site / "ssdlocal" / "_pairs"
    assert int(count) == len(list((ROOT / "models" / "pairs").glob("*.toml")))
    assert Path(module).is_relative_to(site)
