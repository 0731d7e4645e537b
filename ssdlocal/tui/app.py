"""Textual apps for `ssdlocal chat` and `ssdlocal race`.

Each app loads the engine in a background thread (the UI shows at once), hands it to
its screen, shows failures as an ErrorModal, and on quit cancels `quitting`, the parent
of every generate call's CancelToken. Quit never waits for a model load (it cannot be
interrupted): after `run()` the caller closes what `release_engine()` returns, and an
engine that finishes loading later is closed by the loading thread itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from textual.app import App, SystemCommand
from textual.screen import Screen

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import EngineConfig, Mode, SamplingParams, SpecConfig
from ssdlocal.tui.core import ChatSettings, EngineLike, describe_pair, error_text, progress_line
from ssdlocal.tui.load import Meter, sample
from ssdlocal.tui.messages import EngineReady, LoadProgress, WorkFailed
from ssdlocal.tui.screens.chat import ChatScreen
from ssdlocal.tui.screens.dialogs import ErrorModal
from ssdlocal.tui.screens.race import RaceScreen

EngineFactory = Callable[[], EngineLike]


class EngineApp(App):
    """Shared by both apps: background engine loading and error display."""

    CSS_PATH = Path(__file__).with_name("ssdlocal.tcss")
    ENABLE_COMMAND_PALETTE = True

    def __init__(self, load_engine: EngineFactory, config: EngineConfig) -> None:
        super().__init__()
        self.load_engine = load_engine
        self.engine_config = config
        self.engine: EngineLike | None = None
        self.loaded_engine: EngineLike | None = None
        self.load_failed = False  # the CLI then exits with status 1
        self.pair, self.placement = describe_pair(config)
        self.main: Screen | None = None
        self.quitting = CancelToken()  # parent of every generate call's token
        self._loader: threading.Thread | None = None
        self._load_lock = threading.Lock()
        self._released = False  # the caller took over: a late engine is closed on arrival
        self._last_progress = 0.0
        self._stage_starts: dict[str, float] = {}

    def make_screen(self) -> Screen:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_mount(self) -> None:
        self.main = self.make_screen()
        self.push_screen(self.main)
        # A plain daemon thread, not a Textual worker: the app's exit waits for workers.
        self._loader = threading.Thread(target=self._load, name="ssdlocal-load", daemon=True)
        self._loader.start()

    @property
    def loading(self) -> bool:
        return self._loader is not None and self._loader.is_alive()

    def _load(self) -> None:
        from ssdlocal.core.progress import showing

        try:
            with showing(self._loading_progress):  # what the load reports reaches the screen
                engine = self.load_engine()
        except BaseException as exc:  # noqa: BLE001 - shown in a modal, never a traceback
            self.post_message(WorkFailed("Could not load the models", *error_text(exc)))
            return
        with self._load_lock:
            late = self._released
            if not late:
                self.loaded_engine = engine
        if late:  # the app quit while this loaded: nobody else will close it
            engine.close()
            return
        self.post_message(EngineReady(engine))

    def _loading_progress(self, stage: str, done: float, total: float | None) -> None:
        """From the loading thread: at most a few messages a second reach the screen."""
        now = time.monotonic()
        finished = total is not None and done >= total
        if not finished and now - self._last_progress < 0.25:
            return
        self._last_progress = now
        self.post_message(
            LoadProgress(stage, done, total, progress_line(stage, done, total, self._stage_start(stage, now)))
        )

    def _stage_start(self, stage: str, now: float) -> float:
        return self._stage_starts.setdefault(stage, now)

    def on_load_progress(self, msg: LoadProgress) -> None:
        if self.main is not None and hasattr(self.main, "loading_progress"):
            self.main.loading_progress(msg.line)

    def release_engine(self) -> EngineLike | None:
        """After `run()`: the loaded engine for the caller to close (None if there is none
        yet; one still loading is closed by the loading thread when it is ready)."""
        with self._load_lock:
            self._released = True
            engine, self.loaded_engine = self.loaded_engine, None
        return engine

    def on_engine_ready(self, msg: EngineReady) -> None:
        self.engine = msg.engine
        self.main.engine_ready(msg.engine)

    def on_work_failed(self, msg: WorkFailed) -> None:
        self.load_failed = True
        self.main.engine_failed()
        self.show_error(msg.title, msg.message, msg.hint)

    def show_error(self, title: str, message: str, hint: str = "") -> None:
        self.push_screen(ErrorModal(title, message, hint))

    async def action_quit(self) -> None:
        self.quitting.cancel()  # a running generate stops after its round, none starts
        self.exit()


class ChatApp(EngineApp):
    TITLE = "ssdlocal chat"

    def __init__(
        self,
        load_engine: EngineFactory,
        config: EngineConfig,
        settings: ChatSettings,
        system: str | None = None,
        meter: Meter = sample,
    ) -> None:
        super().__init__(load_engine, config)
        self.chat_settings = settings
        self.system = system
        self.meter = meter  # the machine's load around each answer (tests: a fake)

    def make_screen(self) -> ChatScreen:
        return ChatScreen(self.chat_settings, self.pair, self.placement, self.system, self.meter)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, ChatScreen):
            return
        for mode in (Mode.AR, Mode.SD, Mode.SSD):
            yield SystemCommand(
                f"Mode: {mode.value.upper()}",
                f"decode with {mode.value.upper()}",
                lambda m=mode: screen.set_mode(m),
            )
        yield SystemCommand("K +1", "one more draft token per round", screen.action_k_up)
        yield SystemCommand("K -1", "one draft token fewer per round", screen.action_k_down)
        yield SystemCommand("Temperature +0.1", "sample more freely", screen.action_temp_up)
        yield SystemCommand("Temperature -0.1", "sample more greedily", screen.action_temp_down)
        yield SystemCommand("Stop generation", "stop after the current round", screen.action_stop)
        yield SystemCommand("Copy last answer", "to the clipboard", screen.action_copy)
        yield SystemCommand("Clear conversation", "forget the history", screen.action_clear)
        yield SystemCommand("Toggle token colours", "colour tokens by origin", screen.action_toggle_colors)
        yield SystemCommand("Help", "slash commands and keys", screen.action_help)


class RaceApp(EngineApp):
    TITLE = "ssdlocal race"

    def __init__(
        self,
        load_engine: EngineFactory,
        config: EngineConfig,
        prompt: str,
        specs: list[SpecConfig],
        params: SamplingParams,
        **options,
    ) -> None:
        """`options`: RaceScreen's (chat, warmup, speed, clock, default_config: the settings
        without the race's own changes, meter: samples the machine's load)."""
        super().__init__(load_engine, config)
        self.race_args = (prompt, specs, params)
        self.race_options = {"config": config, **options}

    def make_screen(self) -> RaceScreen:
        return RaceScreen(*self.race_args, pair=self.pair, placement=self.placement, **self.race_options)
