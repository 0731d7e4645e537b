"""Check built distributions: the wheel holds every module, the pair registry and all
package data; the sdist holds models/pairs and setup.py; versions agree.

Usage: python packaging/verify_dist.py DIST_DIR   (exit 1 with a list of problems)
Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def package_version() -> str:
    text = (ROOT / "ssdlocal" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


def source_files() -> list[str]:
    """Files under ssdlocal/ that belong in the wheel (git-tracked when git is available)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "ssdlocal"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(ROOT)) for p in (ROOT / "ssdlocal").rglob("*") if p.is_file()]
    return sorted(f for f in out if "__pycache__" not in f and not f.endswith(".pyc") and (ROOT / f).is_file())


def check_wheel(wheel: Path) -> list[str]:
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for f in source_files():
        if f not in names:
            problems.append(f"wheel lacks {f}")
    for toml in sorted((ROOT / "models" / "pairs").glob("*.toml")):
        if f"ssdlocal/_pairs/{toml.name}" not in names:
            problems.append(f"wheel lacks the pair file ssdlocal/_pairs/{toml.name}")
    stray = sorted(
        {n.split("/")[0] for n in names}
        - {"ssdlocal", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    )
    if stray:
        problems.append(f"wheel has unexpected top-level entries: {stray}")
    return problems


def check_sdist(sdist: Path) -> list[str]:
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    need = ["pyproject.toml", "setup.py"] + [
        f"models/pairs/{p.name}" for p in (ROOT / "models" / "pairs").glob("*.toml")
    ]
    return [f"sdist lacks {n}" for n in need if n not in names]


def main(dist: str) -> int:
    dist_dir = Path(dist)
    version = project_version()
    problems = []
    if package_version() != version:
        problems.append(f"ssdlocal.__version__ {package_version()} != pyproject {version}")
    wheels = sorted(dist_dir.glob(f"ssdlocal-{version}-*.whl"))
    sdists = sorted(dist_dir.glob(f"ssdlocal-{version}.tar.gz"))
    if not wheels:
        problems.append(f"no ssdlocal-{version} wheel in {dist_dir}")
    if not sdists:
        problems.append(f"no ssdlocal-{version}.tar.gz sdist in {dist_dir}")
    for w in wheels:
        problems += check_wheel(w)
    for s in sdists:
        problems += check_sdist(s)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if not problems:
        print(f"ok: {', '.join(p.name for p in wheels + sdists)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "dist"))
