"""RaceScreen: AR | SD | SSD side by side on one prompt, replayed with measured timings.

A thread worker records the three runs one after another (they would slow each other
down if run at once on this hardware), each again once when other load disturbed it; the
screen then replays every pane against its own recorded per-token timestamps and shows
the summary table with what stands beside it (facts.footer_lines: same output and
why not, how the modes were made exact, disturbed timings, what auto picks here). The
SSD pane says where its draft runs and, sharing the target's hardware, what it would give
on hardware of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from rich.console import Group
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Static

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import EngineConfig, Mode, SamplingParams, SpecConfig
from ssdlocal.tui.core import EngineLike, claim_engine_device, error_text
from ssdlocal.tui.load import Meter, sample
from ssdlocal.tui.messages import RaceProgress, RaceRecorded, RaceRerun, WorkFailed
from ssdlocal.tui.race import RaceRun, identical_verdict, record_mode, summarize, summary_legend, summary_table
from ssdlocal.tui.facts import footer_lines, ssd_note
from ssdlocal.tui.widgets.header import PairHeader
from ssdlocal.tui.widgets.race_pane import RacePane

FPS = 30
NOTE = (
    "The three runs were generated one after another (at once they would slow each "
    "other down) and are replayed side by side with measured timings."
)


class RaceScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "replay", "Replay"),
        Binding("s", "skip", "Skip to end"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(
        self,
        prompt: str,
        specs: list[SpecConfig],
        params: SamplingParams,
        *,
        pair: str,
        placement: str,
        chat: bool = True,
        warmup: bool = True,
        speed: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        config: EngineConfig | None = None,
        default_config: EngineConfig | None = None,
        meter: Meter = sample,
    ) -> None:
        super().__init__()
        self.prompt, self.specs, self.params = prompt, specs, params
        self.pair, self.placement = pair, placement
        self.config, self.default_config, self.meter = config, default_config, meter
        self.chat, self.warmup, self.speed, self.clock = chat, warmup, speed, clock
        self.engine: EngineLike | None = None
        self.runs: list[RaceRun | None] = [None] * len(specs)
        self._t0 = 0.0
        self._timer: Timer | None = None
        self.finished = False
        self.rows: list = []
        self.verdict = ""
        self.footer: list[str] = []

    def compose(self) -> ComposeResult:
        yield PairHeader("race", self.pair, self.placement, id="header")
        prompt = self.prompt if len(self.prompt) < 200 else self.prompt[:197] + "…"
        yield Static(Text.assemble(("prompt: ", "bold"), prompt, "\n", (NOTE, "italic dim")), id="race-note")
        with Horizontal(id="panes"):
            for spec in self.specs:
                note = ssd_note(self.config, short=True) if spec.mode is Mode.SSD and self.config is not None else ""
                yield RacePane(spec.mode.value, note, id=f"pane-{spec.mode.value}")
        yield Static(Text("loading models…", style="italic"), id="summary")
        yield Footer()

    @property
    def panes(self) -> list[RacePane]:
        return list(self.query(RacePane))

    def _summary(self, text) -> None:
        self.query_one("#summary", Static).update(text)

    # ------------------------------------------------------------------ recording
    def loading_progress(self, line: str) -> None:
        """A loading step's progress (the app forwards core.progress reports)."""
        if self.engine is None:
            self._summary(Text(line, style="italic"))

    def engine_ready(self, engine: EngineLike) -> None:
        self.engine = engine
        self._summary(Text("warming up…" if self.warmup else "recording…", style="italic"))
        self._record()

    def engine_failed(self) -> None:
        self._summary(Text("models failed to load — press q to quit", style="bold red"))

    @work(thread=True, exclusive=True, group="race", exit_on_error=False)
    def _record(self) -> None:
        engine = self.engine
        stop = CancelToken(parent=self.app.quitting)  # quitting stops this run and the rest
        try:
            claim_engine_device(engine)  # this worker thread runs the engine
            ids = engine.encode(self.prompt, self.chat)
            if self.warmup:  # first calls pay one-time costs (allocation, lazy draft load)
                short = SamplingParams(
                    temperature=self.params.temperature,
                    seed=self.params.seed,
                    max_new_tokens=min(4, self.params.max_new_tokens),
                )
                for spec in self.specs:
                    for _ in engine.generate([ids], short, spec=spec, cancel=stop):
                        pass
                    if stop.cancelled:
                        return
            for i, spec in enumerate(self.specs):
                if stop.cancelled:
                    return
                self.post_message(RaceProgress(i, 0))
                run = record_mode(
                    engine,
                    ids,
                    self.params,
                    spec,
                    clock=self.clock,
                    on_tokens=lambda n, new, i=i: self.post_message(RaceProgress(i, n, new)),
                    on_rerun=lambda load, i=i: self.post_message(RaceRerun(i, load.describe())),
                    cancel=stop,
                    meter=self.meter,
                )
                self.post_message(RaceRecorded(i, run))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a modal
            self.post_message(WorkFailed("Race failed", *error_text(exc)))

    def on_race_progress(self, msg: RaceProgress) -> None:
        self.panes[msg.index].recording(msg.tokens, msg.pieces)
        mode = self.specs[msg.index].mode.value.upper()
        self._summary(Text(f"recording {mode} ({msg.index + 1}/{len(self.specs)})…", style="italic"))

    def on_race_rerun(self, msg: RaceRerun) -> None:
        self.panes[msg.index].rerunning(msg.why)

    def on_race_recorded(self, msg: RaceRecorded) -> None:
        self.runs[msg.index] = msg.run
        self.panes[msg.index].recorded(msg.run)
        if all(r is not None for r in self.runs):
            self.action_replay()

    def on_work_failed(self, msg: WorkFailed) -> None:
        msg.stop()
        self._summary(Text(f"failed: {msg.message}", style="bold red"))
        self.app.show_error(msg.title, msg.message, msg.hint)

    # ------------------------------------------------------------------ replay
    def action_replay(self) -> None:
        if not all(r is not None for r in self.runs):
            return
        if self._timer is not None:
            self._timer.stop()
        for pane in self.panes:
            pane.reset()
        self.finished = False
        self._summary(Text("replaying with measured timings…  (s: skip to the end)", style="italic"))
        self._t0 = time.monotonic()
        self._timer = self.set_interval(1 / FPS, self._tick)

    def action_skip(self) -> None:
        if all(r is not None for r in self.runs):
            self._show(float("inf"))

    def _tick(self) -> None:
        self._show((time.monotonic() - self._t0) * self.speed)

    def _show(self, t: float) -> None:
        done = [pane.show_until(t) for pane in self.panes]
        if all(done) and not self.finished:
            self.finished = True
            if self._timer is not None:
                self._timer.stop()
                self._timer = None
            runs = [r for r in self.runs if r is not None]
            rows = summarize(runs)
            self.rows = rows
            self.footer = [identical_verdict(rows, self.params.greedy)]
            if self.config is not None:
                self.footer = footer_lines(rows, self.config, self.default_config, self.params.greedy)
                for pane in self.panes:
                    if pane.mode == Mode.SSD.value:
                        pane.set_note(
                            ssd_note(self.config, runs, short=True, costs=getattr(self.engine, "costs", None))
                        )
            self.verdict = self.footer[0] if self.footer else ""
            lines = [Text(line, style="bold" if n == 0 else "") for n, line in enumerate(self.footer)]
            self._summary(
                Group(
                    summary_table(rows),
                    Text(summary_legend(), style="dim"),
                    *lines,
                    Text("r: replay  q: quit", style="dim"),
                )
            )
