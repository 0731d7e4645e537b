"""RacePane: one mode's column in the race — title, live tokens/s, a note (SSD: where its
draft runs and what it would give on hardware of its own), streaming text."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from ssdlocal.tui.core import Piece
from ssdlocal.tui.race import RaceRun
from ssdlocal.tui.widgets.transcript import AnswerText


class RacePane(Vertical):
    """Shows a RaceRun up to a replay time; also a status line while recording."""

    def __init__(self, mode: str, note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode = mode
        self.note = note
        self.race_run: RaceRun | None = None
        self._shown = 0

    def compose(self) -> ComposeResult:
        yield Static(Text(self.mode.upper(), style="bold"), classes="pane-title")
        yield Static("waiting", classes="pane-meter")
        yield Static(Text(self.note, style="dim italic"), classes="pane-note")
        with VerticalScroll(classes="pane-body"):
            yield AnswerText(colors=True)

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".pane-note", Static).update(Text(note, style="dim italic"))
        self.query_one(".pane-note", Static).display = bool(note)

    def on_mount(self) -> None:
        self.query_one(".pane-note", Static).display = bool(self.note)

    def rerunning(self, why: str) -> None:
        """The recorded run was disturbed: it is recorded again from nothing."""
        self.reset()
        self.meter.update(Text(f"again: {why}", style="italic yellow"))

    @property
    def meter(self) -> Static:
        return self.query_one(".pane-meter", Static)

    @property
    def body(self) -> AnswerText:
        return self.query_one(AnswerText)

    def recording(self, tokens: int, pieces: list[Piece]) -> None:
        """Live text while this mode is being recorded (the replay starts from scratch)."""
        self.meter.update(Text(f"recording (live)… {tokens} tokens", style="italic"))
        if pieces:
            self.body.append(pieces)
            self.query_one(".pane-body", VerticalScroll).scroll_end(animate=False)

    def recorded(self, run: RaceRun) -> None:
        self.race_run = run
        self.meter.update(
            Text(
                f"recorded {run.tokens} tokens in {run.wall_s:.2f} s — waiting for the others",
                style="dim",
            )
        )

    def reset(self) -> None:
        self._shown = 0
        self.body.pieces = []
        self.body.refresh_text()

    def show_until(self, t: float) -> bool:
        """Show everything that had arrived by replay time t; True once complete."""
        run = self.race_run
        if run is None:
            return True
        n = run.shown(t)
        if n > self._shown:
            self.body.append([p for pieces in run.pieces[self._shown : n] for p in pieces])
            self._shown = n
            self.query_one(".pane-body", VerticalScroll).scroll_end(animate=False)
        done = n == len(run.times)
        rate = run.rate_at(t)
        elapsed = min(t, run.wall_s)
        meter = Text.assemble(
            ("–" if rate is None else f"{rate:6.1f}", "bold"),
            " tok/s  ",
            (f"{run.tokens_at(t):>4} tokens  {elapsed:5.2f} s", "dim"),
        )
        if done:
            meter.append("  done", style="bold green")
            if run.load is not None and run.load.disturbed:
                meter.append(" *", style="bold yellow")
        self.meter.update(meter)
        return done
