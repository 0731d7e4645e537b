"""What the engine hands its loop: one typed object (`EngineParts`) whose parts the loop uses
only through their public methods.

The parts: the target's runner and the guard that maps its out-of-memory failures, the
draft side (engine/drafts.py), the mode policy (`Modes`: auto resolved, and why), the
context limits (engine/limits.py), the suffix memory with its file (`SuffixStore`), row
cancels from other threads (`RowCancels`), the host-wait audit, and the target's
vocabulary facts. The Engine builds it once, after everything has loaded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ssdlocal.backends.base import Runner
from ssdlocal.core.config import Mode, SpecConfig
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.memory import oom_error
from ssdlocal.core.sequence import Decoder, FinishReason, Row
from ssdlocal.engine.auto import ModeChoice
from ssdlocal.engine.drafts import DraftSide
from ssdlocal.engine.limits import ContextLimits
from ssdlocal.speculation.adaptive import CostModel

if TYPE_CHECKING:
    from ssdlocal.draft.suffix import MemoryFile
    from ssdlocal.speculation.suffix import SuffixMemory

T = TypeVar("T")
log = logging.getLogger(__name__)


class Guard:
    """guard(fn, *args): fn(*args) on the target, with running out of memory turned into a
    clear error (core.memory.OutOfMemoryError) naming the device."""

    def __init__(self, device: object) -> None:
        self.device = device

    def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            mapped = oom_error(exc, f"running the target on {self.device}")
            if mapped is None:
                raise
            raise mapped from exc


class RowCancels:
    """Rows of the running call that other threads asked to stop (Engine.cancel_rows)."""

    def __init__(self) -> None:
        self._rows: set[int] = set()
        self._lock = threading.Lock()

    def add(self, rows: Iterable[int]) -> None:
        with self._lock:
            self._rows.update(rows)

    def take(self) -> set[int]:
        """The rows asked for so far (forgotten here)."""
        with self._lock:
            taken, self._rows = self._rows, set()
        return taken

    def apply(self, rows: Sequence[Row]) -> None:
        """Finish the asked-for rows of `rows` ("cancelled"); the others go on unchanged."""
        for b in self.take():
            if 0 <= b < len(rows):
                rows[b].finish(FinishReason.CANCELLED)


class SuffixStore:
    """The engine's memory of earlier prompts and answers (suffix proposals), and the file
    that keeps it across processes when asked (draft.suffix.MemoryFile, or None)."""

    def __init__(self, memory: SuffixMemory, file: MemoryFile | None) -> None:
        self.memory, self.file = memory, file

    def remember(self, rows: Iterable[Row]) -> None:
        """Keep these rows' prompts and answers, and save the memory when it has a file."""
        for row in rows:
            self.memory.add(row.tokens)
        if self.file is not None:
            self.file.save(self.memory)


class Modes:
    """How a call's settings run: `auto` resolved to the engine's choice, SSD to SD once the
    draft side gave up on its worker (`drafts.ssd_given_up`), and why."""

    def __init__(self, configured: SpecConfig, choice: ModeChoice, drafts: DraftSide) -> None:
        self.configured, self.choice, self.drafts = configured, choice, drafts
        self._said = False

    def resolved(self, spec: SpecConfig) -> SpecConfig:
        """`spec` as a call runs it: auto resolved to the engine's mode; SSD's K, which its
        trees are built for, at most SpecConfig's default when K was left to the engine; SSD
        as SD once its workers kept failing."""
        if spec.mode is Mode.AUTO:
            spec = replace(spec, mode=self.choice.mode)
        if spec.mode is Mode.SSD and self.drafts.ssd_given_up:
            if not self._said:
                log.warning("%s", self.drafts.gave_up)
                self._said = True
            return replace(spec, mode=Mode.SD)
        if spec.mode is Mode.SSD and spec.adaptive_k and spec.k > SpecConfig.k:
            spec = replace(spec, k=SpecConfig.k, fan_out=None, fan_out_miss=None)
        return spec

    def reason(self, spec: SpecConfig) -> str:
        """Why a call with `spec` runs the mode it runs: the engine's choice (auto, or its
        configured mode), or the mode this call asked for."""
        if self.drafts.ssd_given_up and Mode.SSD in (spec.mode, self.choice.mode):
            return self.drafts.gave_up
        if spec.mode is Mode.AUTO or spec is self.configured:
            return self.choice.reason
        return f"--mode {spec.mode.value} was asked for"


@dataclass(frozen=True)
class EngineParts:
    """Everything the loop (engine/batch.py) uses, built once by the Engine."""

    target: Runner
    guard: Guard
    drafts: DraftSide
    modes: Modes
    limits: ContextLimits
    suffix: SuffixStore
    cancels: RowCancels
    audit: Audit
    costs: CostModel  # measured step costs, kept up to date across calls
    rates: dict[str, float]  # acceptance by proposal source, learned across calls
    vocab_size: int
    hidden_size: int
    eos_ids: frozenset[int]
    tokenizer: Decoder
