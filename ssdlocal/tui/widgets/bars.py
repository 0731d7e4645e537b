"""Tiny text bar charts for the stats panel (pure functions returning rich Text)."""

from __future__ import annotations

from rich.text import Text

BLOCKS = " ▏▎▍▌▋▊▉█"


def hbar(fraction: float | None, width: int, style: str = "", empty: str = "dim") -> Text:
    """A horizontal bar `width` cells wide, filled to `fraction` in eighths of a cell."""
    if fraction is None:
        return Text("·" * width, style=empty)
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (BLOCKS[part] if part else "")
    return Text.assemble((bar, style), ("░" * (width - len(bar)), empty))
