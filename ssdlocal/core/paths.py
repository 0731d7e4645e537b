"""Where ssdlocal keeps files: the cache (models, conversions) and the config directory.

Environment variables are read at call time, never at import time. The progress
callback type that long file operations accept lives in core/progress.py (re-exported);
this module also says which files are ssdlocal's own (a hint may tell the user to delete
only those).
"""

from __future__ import annotations

import os
from pathlib import Path

from ssdlocal.core.errors import UsageError
from ssdlocal.core.progress import ProgressCallback  # noqa: F401 - re-exported


def _user_dir(explicit: str, xdg: str, fallback: str) -> Path:
    """`$explicit`, else `$xdg/ssdlocal`, else `~/<fallback>/ssdlocal`."""
    if os.environ.get(explicit):
        return Path(os.environ[explicit]).expanduser()
    base = os.environ.get(xdg)
    return (Path(base).expanduser() if base else Path.home() / fallback) / "ssdlocal"


def _usable(path: Path, variable: str, default: str) -> Path:
    """`path` unless it, or the nearest of its parents that exists, is not a directory
    (then nothing could ever be written there): UsageError naming it."""
    for existing in (path, *path.parents):
        if not existing.exists():
            continue
        if not existing.is_dir():
            what = "is not a directory" if existing == path else f"cannot be made: {existing} is not a directory"
            raise UsageError(
                f"ssdlocal's folder {path} {what}", f"point {variable} at a directory (unset, it is {default})"
            )
        return path
    return path


def cache_dir() -> Path:
    """`$SSDLOCAL_CACHE`, else `$XDG_CACHE_HOME/ssdlocal`, else `~/.cache/ssdlocal`."""
    return _usable(_user_dir("SSDLOCAL_CACHE", "XDG_CACHE_HOME", ".cache"), "SSDLOCAL_CACHE", "~/.cache/ssdlocal")


def config_dir() -> Path:
    """`$SSDLOCAL_CONFIG_DIR`, else `$XDG_CONFIG_HOME/ssdlocal`, else `~/.config/ssdlocal`."""
    return _usable(
        _user_dir("SSDLOCAL_CONFIG_DIR", "XDG_CONFIG_HOME", ".config"), "SSDLOCAL_CONFIG_DIR", "~/.config/ssdlocal"
    )


def config_file() -> Path:
    return config_dir() / "config.toml"


def in_cache(path: Path) -> bool:
    """Whether `path` lies in ssdlocal's cache (something ssdlocal wrote, safe to delete)."""
    try:
        return Path(path).resolve().is_relative_to(cache_dir().resolve())
    except (OSError, RuntimeError):
        return False


def replace_hint(path: Path) -> str:
    """What to do about a damaged model file: delete what ssdlocal fetched or built (it
    does so again), replace anything else (never delete the user's files)."""
    if in_cache(path):
        return f"delete {path} and rerun: ssdlocal fetches or builds it again"
    return f"{path} may be damaged or not a model file: replace it with a good copy, or pass another model path"
