"""Events the engine yields while generating; CLI, TUI and bench consume them.

Events are plain frozen dataclasses: no UI library is imported here or by the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class TokenOrigin(str, Enum):
    """Where an emitted token came from (for colouring in the TUI)."""

    DRAFT_HIT = "draft_hit"  # accepted draft token served from the speculation cache
    DRAFT = "draft"  # accepted draft token proposed on this round (SD, or SSD miss)
    TARGET = "target"  # bonus token sampled by the target (and every AR token)


class LazySnapshot(Mapping):
    """A metrics snapshot computed when first read (most rounds' snapshots are never read);
    read it in the thread that consumes the engine's events, or copy it with dict()."""

    def __init__(self, compute: Callable[[], dict[str, Any]]) -> None:
        self._compute = compute
        self._data: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._compute()
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


@dataclass(frozen=True)
class PrefillEvent:
    """Every prompt was fed to the target (before the first tokens)."""

    seconds: float  # the prefill's wall time (forward over the prompts + first token)
    rows: int  # prompts in the call
    prompt_tokens: tuple[int, ...] = ()  # per row: the prompt's length
    cached_tokens: tuple[int, ...] = ()  # per row: prompt tokens taken from the prefix cache (not read)


@dataclass(frozen=True)
class PrefillProgress:
    """How far the reading of the prompts has come (long prompts are read in chunks)."""

    done: int  # prompt tokens read so far (of the longest row, prefix-cache hits included)
    total: int  # that row's prompt length


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token and of its most likely
    alternatives (core.logprobs says from which distribution)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass(frozen=True)
class TokensEvent:
    """New committed tokens of one row (`row` indexes the prompts / samples)."""

    row: int
    token_ids: tuple[int, ...]
    text: str  # decoded text delta, safe to print as it arrives
    origins: tuple[str, ...] = ()  # one TokenOrigin value per token
    finish_reason: str | None = None  # set on the row's last event: "eos" | "stop" | "length" | "error"
    at: float = field(default_factory=time.perf_counter)  # when the engine committed them
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the call asked for them
    error: str | None = None  # with finish_reason "error": why the row could not go on


@dataclass(frozen=True)
class RoundEvent:
    """One target verification finished: what each active row drafted, accepted and took,
    and what the round cost. core.stats.RunStats turns these into every metric."""

    round_index: int
    n_drafted: tuple[int, ...]  # per active row
    n_accepted: tuple[int, ...]
    cache_hit: tuple[bool, ...] | None = None  # SSD only
    backup: str | None = None
    # the call's metrics, computed when first read: read it before pulling the next event
    # (or copy it with dict()) for the values as of this round
    snapshot: Mapping[str, Any] = field(default_factory=dict)
    rows: tuple[int, ...] = ()  # the row index of each entry of n_drafted / n_accepted
    n_emitted: tuple[int, ...] = ()  # tokens each row took (accepted + bonus, after stopping rules)
    draft_s: float = 0.0  # drafting wall time of this round (proposal)
    verify_s: float = 0.0  # the target's scoring + verification + read-back
    draft_busy_s: float | None = None  # SSD: the worker's compute since its previous proposal
    sources: tuple[str, ...] | None = None  # per row: "model" | "suffix" | "none" (adaptive K)
    constrained: tuple[bool, ...] | None = None  # per row: under a grammar (None: no row is)
    mask_s: tuple[float, ...] | None = None  # per row: grammar time this round (masks, walks)


@dataclass(frozen=True)
class ModeEvent:
    """The engine changed its mind about the mode mid-call (its rounds measured the chosen
    mode slower than another): from the next round on the call runs `mode`."""

    round_index: int  # the last round run in the old mode
    mode: str
    reason: str  # the whole story
    short: str  # one line for people


@dataclass(frozen=True)
class SeatedEvent:
    """Serving (Engine.serve): a batch of rows starts, before its new rows' prompts are
    read. Row b serves request `requests[b]` (engine.request.Request.id) until the next
    SeatedEvent: the row indices of later events refer to this seating. `joined`: the
    requests new in it (the others carry on from the previous seating)."""

    requests: tuple[int, ...]
    joined: tuple[int, ...]


@dataclass(frozen=True)
class SeatingDoneEvent:
    """Serving: the seating of the latest SeatedEvent ended (its rows re-seat or leave);
    `stats`: its core.stats snapshot, as a generate call's DoneEvent carries."""

    stats: dict[str, Any]


@dataclass(frozen=True)
class Output:
    """Final result for one row."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"


@dataclass(frozen=True)
class DoneEvent:
    """Generation finished for every row."""

    outputs: tuple[Output, ...]
    stats: dict[str, Any]


Event = PrefillEvent | TokensEvent | RoundEvent | ModeEvent | DoneEvent | SeatedEvent | SeatingDoneEvent
