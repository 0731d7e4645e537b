"""Typed Textual messages: the only way background workers reach the UI.

Workers (engine loading, generation, race recording) run in threads and post these;
screens handle them on the event loop. Payloads are plain data (engine events' parts).
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from ssdlocal.core.metrics import Metrics
from ssdlocal.core.sequence import FinishReason
from ssdlocal.tui.core import Piece


class EngineReady(Message):
    """The engine finished loading."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine


class WorkFailed(Message):
    """Background work failed; shown as a modal with the hint (never a crash)."""

    def __init__(self, title: str, message: str, hint: str) -> None:
        super().__init__()
        self.title = title
        self.message = message
        self.hint = hint


class TokensArrived(Message):
    """New committed tokens of the current answer, split into origin-coloured pieces."""

    def __init__(self, turn: int, pieces: list[Piece], n_tokens: int) -> None:
        super().__init__()
        self.turn = turn
        self.pieces = pieces
        self.n_tokens = n_tokens


class PromptProgress(Message):
    """The prompt is being read: `done` of `total` tokens (prefix-cache hits included)."""

    def __init__(self, turn: int, done: int, total: int) -> None:
        super().__init__()
        self.turn = turn
        self.done = done
        self.total = total


class RoundFinished(Message):
    """One verification round finished: fresh metric snapshot for the stats panel."""

    def __init__(self, turn: int, snapshot: Metrics, backup: str | None, cache_hit: bool | None) -> None:
        super().__init__()
        self.turn = turn
        self.snapshot = snapshot
        self.backup = backup
        self.cache_hit = cache_hit


class GenerationDone(Message):
    """The answer is complete (FinishReason.CANCELLED after a stop); `load`: the other
    load on the machine while it ran (a tui.load.Disturbance)."""

    def __init__(self, turn: int, text: str, finish_reason: FinishReason, stats: Metrics, load: Any = None) -> None:
        super().__init__()
        self.turn = turn
        self.text = text
        self.finish_reason = finish_reason
        self.stats = stats
        self.load = load


class RaceProgress(Message):
    """A race run being recorded has produced `tokens` tokens so far (`pieces`: the new text)."""

    def __init__(self, index: int, tokens: int, pieces: list[Piece] | None = None) -> None:
        super().__init__()
        self.index = index
        self.tokens = tokens
        self.pieces = pieces or []


class RaceRerun(Message):
    """A race run was disturbed by other load (`why`) and is recorded again."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__()
        self.index = index
        self.why = why


class RaceRecorded(Message):
    """One race run is recorded (a race.RaceRun)."""

    def __init__(self, index: int, run: Any) -> None:
        super().__init__()
        self.index = index
        self.run = run


class LoadProgress(Message):
    """A loading step reported progress (core.progress): `line` says it for people."""

    def __init__(self, stage: str, done: float, total: float | None, line: str) -> None:
        super().__init__()
        self.stage = stage
        self.done = done
        self.total = total
        self.line = line


class ModeChanged(Message):
    """The engine changed its mind mid-answer (a core.events.ModeEvent)."""

    def __init__(self, turn: int, mode: str, reason: str, short: str) -> None:
        super().__init__()
        self.turn = turn
        self.mode = mode
        self.reason = reason
        self.short = short
