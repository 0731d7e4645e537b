"""PairHeader: the model pair, the placement (which device runs what, with what its weights
really are), and once the engine has chosen it, the mode line every command prints (its
short reason; the chat's F7 shows the whole one). Three lines, none wider than 80 columns
for the default pair; a longer one is cut at the edge rather than wrapped."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class PairHeader(Static):
    """Two lines at the top: `ssdlocal <screen> · target X · draft Y` and the placement."""

    def __init__(self, title: str, pair: str, placement: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._title, self._pair, self._placement = title, pair, placement

    def on_mount(self) -> None:
        self.show_mode(None)

    def show_mode(self, line: str | None) -> None:
        """Redraw, with `line` (e.g. "mode SD: target and draft share ...") when known."""
        text = Text.assemble((f" ssdlocal {self._title} ", "bold reverse"), "  ", (self._pair, "bold"))
        text.append("\n " + self._placement, style="dim")
        if line:
            text.append("\n " + line, style="dim italic")
        text.no_wrap, text.overflow = True, "ellipsis"
        self.update(text)
