"""ChatScreen: multi-turn chat with streaming, coloured answers and live stats.

Generation runs in a thread worker that turns engine events into typed messages
(messages.py); handlers here update the widgets. The screen never blocks on the engine.
Each answer samples the machine's load before and after (tui/load.py) so the stats panel
can say when other work disturbed its timings, and the panel is told why the mode runs
and where the draft runs (tui/facts.py) whenever either changes.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import Mode
from ssdlocal.core.errors import SSDLocalError
from ssdlocal.core.events import DoneEvent, ModeEvent, RoundEvent, TokensEvent
from ssdlocal.core.sequence import FinishReason
from ssdlocal.tui.core import (
    ChatSettings,
    Conversation,
    EngineLike,
    OriginSplitter,
    claim_engine_device,
    error_text,
    run_command,
)
from ssdlocal.tui.facts import answer_reason, draft_place
from ssdlocal.tui.load import Meter, between, sample
from ssdlocal.tui.messages import (
    GenerationDone,
    ModeChanged,
    PromptProgress,
    RoundFinished,
    TokensArrived,
    WorkFailed,
)
from ssdlocal.tui.widgets.header import PairHeader
from ssdlocal.tui.widgets.stats_panel import StatsPanel
from ssdlocal.tui.widgets.transcript import AnswerText, Transcript

TEMP_STEP = 0.1


class ChatScreen(Screen):
    """Input at the bottom, transcript above, stats panel on the right."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"origin--draft_hit", "origin--draft", "origin--target"}

    # the footer shows what fits 80 columns (quitting first); F1 lists the rest
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+q", "app.quit", "Quit", priority=True),
        Binding("escape", "stop", "Stop", priority=True),
        Binding("f1", "help", "Help"),
        Binding("f2", "cycle_mode", "Mode"),
        Binding("f3", "k_down", "K−", show=False),
        Binding("f4", "k_up", "K+", show=False),
        Binding("f5", "temp_down", "T−", show=False),
        Binding("f6", "temp_up", "T+", show=False),
        Binding("f7", "why", "Why"),
        Binding("f8", "toggle_colors", "Colours", show=False),
        Binding("ctrl+y", "copy", "Copy", priority=True),
        Binding("ctrl+l", "clear", "Clear", priority=True, show=False),
    ]

    def __init__(
        self, settings: ChatSettings, pair: str, placement: str, system: str | None = None, meter: Meter = sample
    ) -> None:
        super().__init__()
        self.settings = settings
        self.meter = meter  # the machine's load, sampled around each answer
        self._why = ""  # the reason of the mode the panel shows (a ModeEvent's, mid-answer)
        self.pair, self.placement = pair, placement
        self.conversation = Conversation(system)
        self.engine: EngineLike | None = None
        self.generating = False
        self.stopping = False
        self.show_colors = True
        self.turn = 0
        self.last_answer = ""
        self._answer: AnswerText | None = None
        self._user_text = ""
        self._queued: str | None = None
        self._gen_mode = settings.mode
        self._stop: CancelToken | None = None  # the current answer's
        self._loading_line = ""
        self._reading: tuple[int, int] | None = None  # (done, total) while a long prompt is read

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield PairHeader("chat", self.pair, self.placement, id="header")
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield Transcript(id="transcript")
                yield Static(id="status")
                yield Input(placeholder="Message · Enter sends · Ctrl+Q quits", id="prompt")
            with VerticalScroll(id="side"):
                yield StatsPanel(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(StatsPanel).reset(self.settings.mode)
        self.query_one("#prompt", Input).focus()
        self._update_status()

    def _say_why(self, reason: str | None = None) -> None:
        """Tell the panel why the mode runs (`reason`: the engine's own, when it switched)
        and where the draft runs."""
        config = self.app.engine_config
        auto = getattr(self.engine, "choice", None)
        mode = self._gen_mode if self.generating else self.settings.mode
        self._why = reason or answer_reason(config, mode, auto)
        self.query_one(StatsPanel).show_context(self._why, draft_place(config))

    def loading_progress(self, line: str) -> None:
        """A loading step's progress (the app forwards core.progress reports)."""
        self._loading_line = line
        self._update_status()

    def _update_status(self) -> None:
        if self.engine is None and self._loading_line:  # the step running now, alone
            status = self.query_one("#status", Static)
            room = status.content_size.width or 78
            line = self._loading_line
            if len(line) > room:  # the estimate goes first, then the rest is cut
                line = line.split(" · ")[0]
            status.update(Text(line[:room], style="italic"))
            return
        if self.engine is None:
            state = ("loading models…", "italic")
        elif self.stopping:
            state = ("stopping…", "bold yellow")
        elif self.generating and self._reading is not None:
            state = (f"reading the prompt {self._reading[0]:,} / {self._reading[1]:,}…", "bold")
        elif self.generating:
            state = (
                "generating…"
                if self._gen_mode is self.settings.mode
                else f"generating ({self._gen_mode.value.upper()})…",
                "bold",
            )
        else:
            state = ("ready", "green")
        if self.show_colors:
            style = {
                o: self.get_component_rich_style(f"origin--{o}", partial=True) for o in ("draft_hit", "draft", "target")
            }
            legend = Text.assemble(
                "   ",
                ("■", style["draft_hit"]),
                " cache-hit draft  ",
                ("■", style["draft"]),
                " draft  ",
                ("■", style["target"]),
                " target",
            )
        else:
            legend = Text("  colours off (F8)", style="dim")
        status = self.query_one("#status", Static)
        room = status.content_size.width or 78
        line = Text.assemble((self.settings.describe(), "bold"), " · ", state)
        if line.cell_len > room:  # one line always: the settings in short, then the state alone
            line = Text.assemble((self.settings.describe(compact=True), "bold"), " · ", state)
        if line.cell_len > room:
            line = Text(*state)
        if self.engine is not None and line.cell_len + legend.cell_len <= room:
            line.append_text(legend)  # the legend only where it fits (F1 explains the colours)
        status.update(line)

    # ------------------------------------------------------------------ engine
    def engine_ready(self, engine: EngineLike) -> None:
        self.engine = engine
        choice = getattr(engine, "choice", None)
        if choice is not None:  # the short line every command prints; F7 shows the whole reason
            self.query_one(PairHeader).show_mode(choice.line)
            if self.settings.mode is Mode.AUTO:  # the chat starts in the mode auto chose
                self.settings = self.settings.with_mode(choice.mode)
                self.query_one(StatsPanel).reset(self.settings.mode)
        self._say_why()
        self._update_status()
        queued, self._queued = self._queued, None
        if queued is not None:
            self.send(queued)

    def engine_failed(self) -> None:
        self.query_one("#status", Static).update(Text("models failed to load — Ctrl+Q to quit", style="bold red"))

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        event.input.value = ""
        if text.startswith("/"):
            self.command(text)
        else:
            self.send(text)

    def command(self, line: str) -> None:
        try:
            result = run_command(line, self.settings)
        except SSDLocalError as exc:
            self.notify(f"{exc.message}\n{exc.hint}", title="command", severity="warning")
            return
        if result.action is not None:
            action = "toggle_colors" if result.action == "colors" else result.action
            getattr(self, f"action_{action}")()
        elif result.settings is not None:
            self._apply(result.settings)

    def _apply(self, settings: ChatSettings) -> None:
        self.settings = settings
        self._update_status()
        if not self.generating:
            self.query_one(StatsPanel).reset(settings.mode)
            self._say_why()
        note = " (applies to the next answer)" if self.generating else ""
        self.notify(settings.describe() + note, title="settings", timeout=2)

    def send(self, text: str) -> None:
        if self.engine is None:
            if self._queued is None:  # keep the text: it is sent once the models are loaded
                self._queued = text
                self.notify("the models are still loading; your message is sent when they are", timeout=4)
            else:
                self.notify("the models are still loading", severity="warning")
            return
        if self.generating:
            self.notify("still answering — press Esc to stop", severity="warning")
            return
        budget = self.engine.max_prompt_tokens(self.settings.max_new_tokens, self.settings.spec)
        try:
            ids, dropped = self.conversation.fit_prompt_ids(self.engine.tokenizer, text, budget)
        except Exception as exc:  # noqa: BLE001 - a bad chat template must not crash the UI
            self.app.show_error("Cannot build the prompt", *error_text(exc))
            return
        if dropped:
            self.notify(
                f"the oldest {dropped} turn(s) no longer fit the models' context and were forgotten",
                title="history",
                timeout=6,
            )
        transcript = self.query_one(Transcript)
        transcript.add_user(text)
        self._answer = transcript.add_answer(self.show_colors)
        self.turn += 1
        self._user_text = text
        self.generating, self.stopping = True, False
        self._reading = None
        self._gen_mode = self.settings.mode
        self.query_one(StatsPanel).reset(self._gen_mode)
        self._say_why()
        self._update_status()
        # made now, so Esc works even before the worker thread has started generating
        self._stop = CancelToken(parent=self.app.quitting)
        self._generate(self.turn, ids, self.settings, self._stop)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _generate(self, turn: int, ids: list[int], settings: ChatSettings, stop: CancelToken) -> None:
        engine = self.engine
        splitter = OriginSplitter(engine.tokenizer)
        before = self.meter()
        try:
            claim_engine_device(engine)  # this worker thread runs the engine
            reading = lambda p: self.post_message(PromptProgress(turn, p.done, p.total))  # noqa: E731
            for ev in engine.generate([ids], settings.sampling, spec=settings.spec, cancel=stop, progress=reading):
                if isinstance(ev, TokensEvent):
                    pieces = splitter.split(ev.token_ids, ev.origins, ev.text)
                    self.post_message(TokensArrived(turn, pieces, len(ev.token_ids)))
                elif isinstance(ev, RoundEvent):
                    ssd = ev.ssd
                    hit = None if ssd is None else all(ssd.cache_hit)
                    self.post_message(
                        RoundFinished(turn, ev.snapshot.metrics, ssd.backup if ssd else None, hit)
                    )  # read here
                elif isinstance(ev, ModeEvent):
                    self.post_message(ModeChanged(turn, ev.mode, ev.reason, ev.short))
                elif isinstance(ev, DoneEvent):
                    out = ev.outputs[0]
                    load = between(before, self.meter())
                    self.post_message(GenerationDone(turn, out.text, out.finish_reason, ev.stats, load))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a modal
            self.post_message(WorkFailed("Generation failed", *error_text(exc)))

    # ------------------------------------------------------------------ messages
    def on_tokens_arrived(self, msg: TokensArrived) -> None:
        if msg.turn == self.turn and self._reading is not None:
            self._reading = None  # the first token: the prompt is read
            self._update_status()
        if msg.turn == self.turn and self._answer is not None:
            self._answer.append(msg.pieces)
            self.query_one(Transcript).scroll_end(animate=False)

    def on_prompt_progress(self, msg: PromptProgress) -> None:
        if msg.turn == self.turn and self.generating:
            self._reading = (msg.done, msg.total)
            self._update_status()

    def on_round_finished(self, msg: RoundFinished) -> None:
        if msg.turn == self.turn:
            self.query_one(StatsPanel).show_stats(
                self._gen_mode,
                msg.snapshot,
                backup=msg.backup,
                cache_hit=msg.cache_hit,
                live=True,
            )

    def on_mode_changed(self, msg: ModeChanged) -> None:
        """The engine switched mode mid-answer: say so, and carry on in the new mode."""
        if msg.turn != self.turn:
            return
        self._gen_mode = Mode(msg.mode)
        if self.settings.spec.mode is not Mode.AUTO and self.settings.mode is not self._gen_mode:
            self.settings = self.settings.with_mode(self._gen_mode)
        self.query_one(PairHeader).show_mode(f"mode {msg.mode}: {msg.short}")
        self._say_why(f"the engine switched to {msg.mode.upper()}: {msg.short}")
        self.notify(msg.reason, title=f"mode {msg.mode}", timeout=8)
        self._update_status()

    def on_generation_done(self, msg: GenerationDone) -> None:
        if msg.turn != self.turn:
            return
        self.generating = self.stopping = False
        self.conversation.add_turn(self._user_text, msg.text)
        self.last_answer = msg.text
        s = msg.stats
        rate = s.tokens_per_s
        note = f"{self._gen_mode.value.upper()} · {s.tokens} tokens"
        if rate:
            note += f" · {rate:.1f} tok/s"
        if msg.finish_reason is FinishReason.CANCELLED:
            note += " · stopped"
        elif msg.finish_reason is FinishReason.LENGTH:
            note += " · max tokens reached"
        if msg.load is not None and msg.load.disturbed:
            note += f" · timings disturbed ({msg.load.describe()})"
        if self._answer is not None:
            self._answer.set_note(note)
        self.query_one(StatsPanel).show_stats(self._gen_mode, s, load=msg.load)
        self._update_status()

    def on_work_failed(self, msg: WorkFailed) -> None:
        msg.stop()
        if self.generating and self._answer is not None:
            self._answer.set_note(f"failed: {msg.message}")
            self.query_one(StatsPanel).freeze()
        self.generating = self.stopping = False
        self._update_status()
        self.app.show_error(msg.title, msg.message, msg.hint)

    # ------------------------------------------------------------------ actions
    def action_stop(self) -> None:
        if self.generating and self._stop is not None:
            self._stop.cancel()
            self.stopping = True
            self._update_status()

    def action_help(self) -> None:
        from ssdlocal.tui.screens.dialogs import HelpModal

        self.app.push_screen(HelpModal())

    def action_why(self) -> None:
        """The whole reason for the mode, and what runs where with which weights."""
        from ssdlocal.tui.core import describe_details
        from ssdlocal.tui.screens.dialogs import WhyModal

        choice = getattr(self.engine, "choice", None)
        self.app.push_screen(WhyModal(describe_details(self.app.engine_config, choice)))

    def _try(self, change) -> None:
        try:
            self._apply(change())
        except SSDLocalError as exc:
            self.notify(f"{exc.message}\n{exc.hint}", title="settings", severity="warning")

    def set_mode(self, mode: Mode) -> None:
        self._try(lambda: self.settings.with_mode(mode))

    def action_cycle_mode(self) -> None:
        self._try(self.settings.next_mode)

    def action_k_down(self) -> None:
        self._try(lambda: self.settings.with_k(self.settings.k - 1))

    def action_k_up(self) -> None:
        self._try(lambda: self.settings.with_k(self.settings.k + 1))

    def action_temp_down(self) -> None:
        self._try(lambda: self.settings.with_temperature(self.settings.temperature - TEMP_STEP))

    def action_temp_up(self) -> None:
        self._try(lambda: self.settings.with_temperature(self.settings.temperature + TEMP_STEP))

    def action_toggle_colors(self) -> None:
        self.show_colors = not self.show_colors
        self.query_one(Transcript).set_colors(self.show_colors)
        self._update_status()

    def action_copy(self) -> None:
        if not self.last_answer:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(self.last_answer)
        self.notify(f"copied the last answer ({len(self.last_answer)} characters)", timeout=2)

    def action_clear(self) -> None:
        if self.generating:
            self.notify("still answering — press Esc to stop first", severity="warning")
            return
        self.conversation.clear()
        self.last_answer = ""
        self._answer = None
        self.query_one(Transcript).remove_children()
        self.query_one(StatsPanel).reset(self.settings.mode)
        self.notify("conversation cleared", timeout=2)
