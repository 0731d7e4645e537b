"""Where ssdlocal keeps files: the cache (models, conversions) and the config directory.

Environment variables are read at call time, never at import time. The progress
callback type that long file operations accept lives in core/progress.py (re-exported).
"""

from __future__ import annotations

import os
from pathlib import Path

from ssdlocal.core.progress import ProgressCallback  # noqa: F401 - re-exported


def _user_dir(explicit: str, xdg: str, fallback: str) -> Path:
    """`$explicit`, else `$xdg/ssdlocal`, else `~/<fallback>/ssdlocal`."""
    if os.environ.get(explicit):
        return Path(os.environ[explicit]).expanduser()
    base = os.environ.get(xdg)
    return (Path(base).expanduser() if base else Path.home() / fallback) / "ssdlocal"


def cache_dir() -> Path:
    """`$SSDLOCAL_CACHE`, else `$XDG_CACHE_HOME/ssdlocal`, else `~/.cache/ssdlocal`."""
    return _user_dir("SSDLOCAL_CACHE", "XDG_CACHE_HOME", ".cache")


def config_dir() -> Path:
    """`$SSDLOCAL_CONFIG_DIR`, else `$XDG_CONFIG_HOME/ssdlocal`, else `~/.config/ssdlocal`."""
    return _user_dir("SSDLOCAL_CONFIG_DIR", "XDG_CONFIG_HOME", ".config")


def config_file() -> Path:
    return config_dir() / "config.toml"
