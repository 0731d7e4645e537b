"""Progress bars on stderr for every long step before an answer (download, assembly, checks,
conversion, quantization, loading, calibration), never on stdout.

On a terminal: one Rich display, a bar per stage with its unit and an estimate of the time
left. Elsewhere (stderr piped or logged, e.g. around `--json`): plain lines, one when a
stage starts, about every 10 s while it runs, and one when it ends. `preparing()` installs
the display for library code that reports through core/progress.py; inside it, a nested
`preparing()` reuses the same display.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from ssdlocal.core import progress as core_progress
from ssdlocal.core.progress import ProgressCallback, unit_of

err_console = Console(stderr=True)  # every line the CLI writes to stderr (render.py re-exports it)

PLAIN_EVERY_S = 10.0  # plain mode: a line at most this often while a stage runs
PLAIN_START_S = 1.0  # plain mode: a stage's first line once it has run this long


def amount(done: float, total: float | None, unit: str) -> str:
    """`3/6 files`, `2/4 steps`, `1.2/3.4 GB` (bytes in decimal units); "" for no unit."""
    if not unit:
        return ""
    if unit == "bytes":
        if total is None:
            return decimal(int(done))
        size = decimal(int(total))
        scale = size.split(" ")[-1]
        factor = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}.get(scale, 1)
        return f"{done / factor:.1f}/{total / factor:.1f} {scale}"
    return f"{done:.0f}/{'?' if total is None else f'{total:.0f}'} {unit}"


class _AmountColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(amount(task.completed, task.total, task.fields.get("unit", "steps")), style="progress.download")


class _Stages:
    """The bars of one display: a task per stage, a new one when a finished stage starts
    over (the same step for the next file)."""

    def __init__(self, add, update, tasks_of) -> None:
        self._add, self._update, self._tasks_of = add, update, tasks_of
        self._tasks: dict[str, object] = {}
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: float, total: float | None) -> None:
        with self._lock:
            task = self._tasks.get(stage)
            if task is not None:
                old = self._tasks_of(task)
                if old is not None and old.finished and done < (old.total or 0):
                    task = None
            if task is None:
                task = self._tasks[stage] = self._add(stage, total, unit_of(stage))
            self._update(task, done, total)


def _rich_display(console: Console):
    bars = Progress(
        TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")),
        BarColumn(bar_width=12),
        _AmountColumn(table_column=Column(no_wrap=True)),
        TimeRemainingColumn(compact=True, elapsed_when_finished=True),
        console=console,
        transient=False,
        expand=False,
    )

    def tasks_of(task_id):
        return next((t for t in bars.tasks if t.id == task_id), None)

    stages = _Stages(
        lambda stage, total, unit: bars.add_task(stage, total=total, unit=unit),
        lambda task, done, total: bars.update(task, completed=done, total=total),
        tasks_of,
    )
    return bars, stages


class _PlainStage:
    def __init__(self, stage: str, total: float | None, now: float) -> None:
        self.stage, self.total, self.unit = stage, total, unit_of(stage)
        self.start = self.last_line = now
        self.done = 0.0
        self.finished = False
        self.announced = False  # its first line is written once it has run PLAIN_START_S
        self.timer: threading.Timer | None = None


class _PlainDisplay:
    """Lines instead of bars, for a stderr that is not a terminal: a stage that ends within
    PLAIN_START_S gets one line; a longer one a line when it has run that long, about every
    PLAIN_EVERY_S after, and one when it ends. A stage cut short by an error that came
    quickly leaves no line (the error is then the only output)."""

    def __init__(self, console: Console, clock=time.monotonic) -> None:
        self.console, self.clock = console, clock
        self.stages: dict[str, _PlainStage] = {}
        self.lock = threading.Lock()

    def __call__(self, stage: str, done: float, total: float | None) -> None:
        with self.lock:
            now = self.clock()
            state = self.stages.get(stage)
            if state is not None and state.finished and done < (state.total or 0):
                state = None
            if state is None:
                state = self.stages[stage] = _PlainStage(stage, total, now)
                state.timer = threading.Timer(PLAIN_START_S, self._announce, (state,))
                state.timer.daemon = True
                state.timer.start()
            state.total, state.done = total, done
            if total is not None and done >= total:
                if not state.finished:
                    state.finished = True
                    self._cancel(state)
                    self._line(state, now)
            elif not state.announced and now - state.start >= PLAIN_START_S:
                self._announce_locked(state, now)
            elif state.announced and now - state.last_line >= PLAIN_EVERY_S:
                self._line(state, now)

    def _announce(self, state: _PlainStage) -> None:
        with self.lock:
            self._announce_locked(state, self.clock())

    def _announce_locked(self, state: _PlainStage, now: float) -> None:
        if not state.finished and not state.announced:
            state.announced = True
            self._line(state, now)

    @staticmethod
    def _cancel(state: _PlainStage) -> None:
        if state.timer is not None:
            state.timer.cancel()

    def _line(self, state: _PlainStage, now: float) -> None:
        state.last_line = now
        done = state.done
        text = f"{state.stage}: {amount(done, state.total, state.unit)}".rstrip(": ")
        elapsed = now - state.start
        if state.total and done >= state.total:
            text += f", done in {elapsed:.0f} s" if elapsed >= 1 else ", done"
        elif state.total and done > 0 and elapsed > 0:
            left = (state.total - done) / (done / elapsed)
            text += f" ({done / state.total:.0%}, about {left:.0f} s left)"
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        with self.lock:
            for state in self.stages.values():
                self._cancel(state)
                if state.total is None and state.announced and not state.finished:
                    state.finished = True  # a stage of unknown length ends with the display
                    self._line(state, self.clock())


@contextlib.contextmanager
def progress_display(console: Console | None = None) -> Iterator[ProgressCallback]:
    """A `progress(stage, done, total)` callback drawing on `console` (stderr by default):
    Rich bars on a terminal, plain lines elsewhere."""
    console = console or err_console
    if console.is_terminal:
        bars, stages = _rich_display(console)
        with bars:
            yield stages
        return
    plain = _PlainDisplay(console)
    try:
        yield plain
    finally:
        plain.close()


@contextlib.contextmanager
def preparing(console: Console | None = None) -> Iterator[ProgressCallback]:
    """Show every step reported inside (core.progress) as progress on stderr; a display
    already installed (an outer `preparing`) is reused."""
    outer = core_progress.current()
    if outer is not None:
        yield outer
        return
    with progress_display(console) as display, core_progress.showing(display):
        yield display
