"""PairHeader: the model pair and the placement (which device / process runs what)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class PairHeader(Static):
    """Two lines at the top: `ssdlocal <screen> · target X · draft Y` and the placement."""

    def __init__(self, title: str, pair: str, placement: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._title, self._pair, self._placement = title, pair, placement

    def on_mount(self) -> None:
        text = Text.assemble(
            (f" ssdlocal {self._title} ", "bold reverse"), "  ", (self._pair, "bold")
        )
        text.append("\n " + self._placement, style="dim")
        self.update(text)
