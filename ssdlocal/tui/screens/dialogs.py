"""Modal dialogs: an error with its hint (never a crashed terminal), and the help."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from ssdlocal.tui.core import COMMANDS_HELP


class _Dialog(ModalScreen[None]):
    """A modal with one button: focused on open; the button or a binding closes it."""

    def on_mount(self) -> None:
        self.query_one(Button).focus(scroll_visible=False)
        dialog = self.query_one("#dialog")
        self.call_after_refresh(dialog.scroll_home, animate=False)  # a tall dialog opens at its title

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss()

    def action_dismiss_modal(self) -> None:
        self.dismiss()


class ErrorModal(_Dialog):
    """`title`, the error message, and the hint saying what to do about it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,enter", "dismiss_modal", "Close")]

    def __init__(self, title: str, message: str, hint: str = "") -> None:
        super().__init__()
        self.title_text, self.message, self.hint = title, message, hint

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="error"):
            yield Static(Text(self.title_text, style="bold"), id="dialog-title")
            yield Static(Text(self.message), id="dialog-message")
            if self.hint:
                yield Static(Text.assemble(("hint: ", "bold"), self.hint), id="dialog-hint")
            yield Button("OK", variant="error", id="dialog-ok")


class HelpModal(_Dialog):
    """Slash commands and key bindings of the chat screen."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,enter,f1,q", "dismiss_modal", "Close")]

    def compose(self) -> ComposeResult:
        text = Text()
        text.append("Commands (type in the input box)\n", style="bold")
        for cmd, what in COMMANDS_HELP:
            text.append(f"  {cmd:<24}", style="bold")
            text.append(what + "\n")
        text.append("\nToken colours (legend under the transcript)\n", style="bold")
        text.append("  cache-hit draft  accepted draft token served from the speculation cache (SSD)\n")
        text.append("  draft            accepted draft token proposed this round (SD, or an SSD miss)\n")
        text.append("  target           token sampled by the target (bonus token; every AR token)\n")
        text.append("\nKeys\n", style="bold")
        text.append(
            "  Ctrl+Q quit · Esc stop · F2 mode · F3/F4 K · F5/F6 temperature\n"
            "  F7 why this mode · F8 colours · Ctrl+Y copy · Ctrl+L clear · Ctrl+P palette\n"
        )
        with Vertical(id="dialog", classes="help"):
            yield Static(Text("ssdlocal chat — help", style="bold"), id="dialog-title")
            yield Static(text, id="dialog-message")
            yield Button("Close", variant="primary", id="dialog-ok")


class WhyModal(_Dialog):
    """Why this mode, and what runs where with which weights (the chat's F7)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,enter,f7,q", "dismiss_modal", "Close")]

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        text = Text()
        for n, (heading, body) in enumerate(self.rows):
            text.append(("\n" if n else "") + heading + "\n", style="bold")
            text.append(body + "\n")
        with Vertical(id="dialog", classes="help"):
            yield Static(Text("What runs where, and why", style="bold"), id="dialog-title")
            yield Static(text, id="dialog-message")
            yield Button("Close", variant="primary", id="dialog-ok")
