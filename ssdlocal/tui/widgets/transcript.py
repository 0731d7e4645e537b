"""Chat transcript: user messages and streaming answers coloured by token origin.

Origin colours come from the stylesheet (component classes `origin--draft_hit`,
`origin--draft`, `origin--target`), so the TUI's look lives in one .tcss file.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from ssdlocal.tui.core import Piece

ORIGIN_CLASSES = ("origin--draft_hit", "origin--draft", "origin--target")


class AnswerText(Static):
    """Streaming text made of (text, origin) pieces; colours can be switched off."""

    COMPONENT_CLASSES: ClassVar[set[str]] = set(ORIGIN_CLASSES)

    def __init__(self, colors: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pieces: list[Piece] = []
        self.show_colors = colors
        self.note = ""

    def append(self, pieces: list[Piece]) -> None:
        self.pieces.extend(pieces)
        self.refresh_text()

    def set_colors(self, on: bool) -> None:
        self.show_colors = on
        self.refresh_text()

    def set_note(self, note: str) -> None:
        self.note = note
        self.refresh_text()

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)

    def refresh_text(self) -> None:
        out = Text()
        styles = {}
        for piece, origin in self.pieces:
            if self.show_colors and origin not in styles:
                styles[origin] = self.get_component_rich_style(f"origin--{origin}", partial=True)
            out.append(piece, style=styles.get(origin, ""))
        if not self.pieces and not self.note:
            out.append("…", style="dim")
        if self.note:
            out.append(("\n" if self.pieces else "") + self.note, style="dim italic")
        self.update(out)

    def on_mount(self) -> None:
        self.refresh_text()


class UserMessage(Static):
    """A user turn."""


class Transcript(VerticalScroll):
    """The conversation; follows the newest text while it streams."""

    def add_user(self, text: str) -> UserMessage:
        msg = UserMessage(Text(text), classes="user")
        self.mount(msg)
        return msg

    def add_answer(self, colors: bool) -> AnswerText:
        answer = AnswerText(colors, classes="answer")
        self.mount(answer)
        self.scroll_end(animate=False)
        return answer

    def set_colors(self, on: bool) -> None:
        for answer in self.query(AnswerText):
            answer.set_colors(on)
