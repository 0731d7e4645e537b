"""Typed Textual messages: the only way background workers reach the UI.

Workers (engine loading, generation, race recording) run in threads and post these;
screens handle them on the event loop. Payloads are plain data (engine events' parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from ssdlocal.core.metrics import Metrics
from ssdlocal.core.sequence import FinishReason
from ssdlocal.tui.core import Piece


@dataclass
class EngineReady(Message):
    """The engine finished loading."""

    engine: Any


@dataclass
class WorkFailed(Message):
    """Background work failed; shown as a modal with the hint (never a crash)."""

    title: str
    message: str
    hint: str


@dataclass
class TokensArrived(Message):
    """New committed tokens of the current answer, split into origin-coloured pieces."""

    turn: int
    pieces: list[Piece]
    n_tokens: int


@dataclass
class PromptProgress(Message):
    """The prompt is being read: `done` of `total` tokens (prefix-cache hits included)."""

    turn: int
    done: int
    total: int


@dataclass
class RoundFinished(Message):
    """One verification round finished: fresh metric snapshot for the stats panel."""

    turn: int
    snapshot: Metrics
    backup: str | None
    cache_hit: bool | None


@dataclass
class GenerationDone(Message):
    """The answer is complete (FinishReason.CANCELLED after a stop); `load`: the other
    load on the machine while it ran (a tui.load.Disturbance)."""

    turn: int
    text: str
    finish_reason: FinishReason
    stats: Metrics
    load: Any = None


@dataclass
class RaceProgress(Message):
    """A race run being recorded has produced `tokens` tokens so far (`pieces`: the new text)."""

    index: int
    tokens: int
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class RaceRerun(Message):
    """A race run was disturbed by other load (`why`) and is recorded again."""

    index: int
    why: str


@dataclass
class RaceRecorded(Message):
    """One race run is recorded (a race.RaceRun)."""

    index: int
    run: Any


@dataclass
class LoadProgress(Message):
    """A loading step reported progress (core.progress): `line` says it for people."""

    stage: str
    done: float
    total: float | None
    line: str


@dataclass
class ModeChanged(Message):
    """The engine changed its mind mid-answer (a core.events.ModeEvent)."""

    turn: int
    mode: str
    reason: str
    short: str
