"""RacePane: one mode's column in the race — title, live tokens/s, streaming text."""

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

    def __init__(self, mode: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode = mode
        self.race_run: RaceRun | None = None
        self._shown = 0

    def compose(self) -> ComposeResult:
        yield Static(Text(self.mode.upper(), style="bold"), classes="pane-title")
        yield Static("waiting", classes="pane-meter")
        with VerticalScroll(classes="pane-body"):
            yield AnswerText(colors=True)

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
        self.meter.update(meter)
        return done
