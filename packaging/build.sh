#!/usr/bin/env bash
# Build the ssdlocal wheel and sdist into DIST (default: dist/) and verify them:
# every module, the pair registry (models/pairs -> ssdlocal/_pairs) and package data
# must be in the wheel, and all version strings must agree (packaging/verify_dist.py).
#
#   packaging/build.sh            # uses `python -m build` if installed (isolated build)
#   NO_ISOLATION=1 packaging/build.sh /tmp/dist   # offline: build with this Python's setuptools
set -euo pipefail
cd "$(dirname "$0")/.."
DIST="${1:-dist}"
PY="${PYTHON:-python}"
rm -rf "$DIST" build ./*.egg-info
mkdir -p "$DIST"
if [[ -z "${NO_ISOLATION:-}" ]] && "$PY" -m build --version >/dev/null 2>&1; then
    "$PY" -m build --outdir "$DIST" .
else
    # no `build` frontend (or offline): pip builds the wheel, setuptools the sdist
    "$PY" -m pip wheel . --no-deps --no-build-isolation -w "$DIST" -q
    "$PY" -c "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])" "$DIST" >/dev/null
fi
rm -rf build ./*.egg-info
"$PY" packaging/verify_dist.py "$DIST"
