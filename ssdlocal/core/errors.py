"""Domain errors. Every user-facing failure is an SSDLocalError carrying a hint.

The CLI turns UsageError into exit code 2 and any other SSDLocalError into exit
code 1, printing `error: ...` and `hint: ...` to stderr. Library code never prints.
"""

from __future__ import annotations


class SSDLocalError(Exception):
    """Base class: a message for the user and a hint saying what to do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class UsageError(SSDLocalError):
    """Bad user input: invalid option values, empty prompt, and so on (exit code 2)."""

    exit_code = 2


class ModelLoadError(SSDLocalError):
    """A checkpoint path is missing, unreadable, or not a supported model."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one ssdlocal implements."""


class IncompatiblePairError(SSDLocalError):
    """Target and draft cannot be used together (tokenizer / vocabulary mismatch)."""


class OutOfMemoryError(SSDLocalError):
    """The device ran out of memory while loading or running a model."""


class DraftWorkerError(SSDLocalError):
    """The asynchronous draft worker died, hung, or answered out of protocol."""


class AssetError(SSDLocalError):
    """Fetching, assembling or verifying downloaded model files failed."""


class PlacementError(SSDLocalError):
    """No placement of the pair fits the devices of this machine."""


class TensorParallelError(SSDLocalError):
    """A tensor-parallel rank failed, died, hung, or the group could not start."""
