"""Named choices that travel between modules as enum members, never as strings.

A `Choice` is made once, where the user's text enters (CLI options, config files, HTTP
bodies), by `parse`, which refuses an unknown value with a UsageError whose hint lists
the choices. Everywhere below that edge code compares members (`is Backup.JIT`). A member
is also its value as a str, so it prints, formats and serialises (JSON, pickle) as the
word the user typed, on every supported Python.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from ssdlocal.core.errors import UsageError

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """Base of the package's choice enums: members are their values as strings."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """Every value, in declaration order (what a hint lists)."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls: type[C], value: str | C, what: str) -> C:  # noqa: PYI019 - typing.Self needs Python 3.11
        """`value` (a member, or the text the user typed; case-insensitive) -> its member.
        `what` names the setting in the error, e.g. "backend" or "--backup". Raises
        UsageError listing the choices when `value` names none."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise UsageError(f"unknown {what} {value!r}", f"choose one of: {', '.join(cls.choices())}") from None
