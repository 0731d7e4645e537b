"""Where ssdlocal keeps files: the cache (models, conversions) and the config directory.

Environment variables are read at call time, never at import time. Also defines the
progress callback type that long file operations (download, assemble, convert) accept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# progress(stage, done, total): stage names the work ("download", "assemble",
# "convert"); total is None when unknown.
ProgressCallback = Callable[[str, int, "int | None"], None]


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
