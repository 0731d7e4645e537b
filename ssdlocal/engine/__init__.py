"""The engine: loads the target (and draft) and runs rounds of
propose -> score -> verify -> commit -> record, yielding events."""

from ssdlocal.engine.engine import Engine

__all__ = ["Engine"]
