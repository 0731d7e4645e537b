"""Events the engine yields while generating; CLI, TUI and bench consume them.

Events are plain frozen dataclasses: no UI library is imported here or by the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ssdlocal.core.metrics import Metrics

from ssdlocal.core.config import Backup
from ssdlocal.core.sequence import FinishReason


class TokenOrigin(str, Enum):
    """Where an emitted token came from (for colouring in the TUI)."""

    DRAFT_HIT = "draft_hit"  # accepted draft token served from the speculation cache
    DRAFT = "draft"  # accepted draft token proposed on this round (SD, or SSD miss)
    TARGET = "target"  # bonus token sampled by the target (and every AR token)


class LazySnapshot:
    """A call's metrics (core.metrics.Metrics) computed when first read (most rounds' are
    never read): read `metrics` in the thread that consumes the engine's events, before
    pulling the next event, for the values as of that round."""

    def __init__(self, compute: Callable[[], Metrics]) -> None:
        self._compute = compute
        self._metrics: Metrics | None = None

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._metrics = self._compute()
        return self._metrics

    def get(self, name: str, default: Any = None) -> Any:
        """One metric by its JSON name (Metrics.get), for callers that hold names."""
        return self.metrics.get(name, default)


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
    finish_reason: FinishReason | None = None  # set on the row's last event
    at: float = field(default_factory=time.perf_counter)  # when the engine committed them
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the call asked for them
    error: str | None = None  # with FinishReason.ERROR: why the row could not go on


@dataclass(frozen=True)
class SsdRound:
    """The SSD part of a proposal or a round, per row: whether the speculation cache
    served it; the backup that drafted the rows it missed (core.config.Backup); the worker's compute since its previous proposal (pre-speculation + serving),
    to compare with the target's verify time."""

    cache_hit: tuple[bool, ...]
    backup: Backup | None = None
    busy_s: float | None = None

    def pick(self, rows: Sequence[int]) -> SsdRound:
        """The same for the rows `rows` only (in that order)."""
        return SsdRound(tuple(bool(self.cache_hit[b]) for b in rows), self.backup, self.busy_s)


@dataclass(frozen=True)
class GrammarRound:
    """The grammar part of a round, per row: whether a grammar constrains it, and the
    grammar time it cost this round (masks, walks along the proposal)."""

    constrained: tuple[bool, ...]
    mask_s: tuple[float, ...]


@dataclass(frozen=True)
class RoundEvent:
    """One target verification finished: what each active row drafted, accepted and took,
    and what the round cost. core.stats.RunStats turns these into every metric.
    Feature parts are None when the round had none of that feature."""

    round_index: int
    n_drafted: tuple[int, ...]  # per active row
    n_accepted: tuple[int, ...]
    snapshot: LazySnapshot | None = None  # the call's metrics as of this round (engine-filled)
    rows: tuple[int, ...] = ()  # the row index of each entry of n_drafted / n_accepted
    n_emitted: tuple[int, ...] = ()  # tokens each row took (accepted + bonus, after stopping rules)
    draft_s: float = 0.0  # drafting wall time of this round (proposal)
    verify_s: float = 0.0  # the target's scoring + verification + read-back
    sources: tuple[str, ...] | None = None  # per row: "model" | "suffix" | "none" (adaptive K)
    ssd: SsdRound | None = None  # per row, like n_drafted
    grammar: GrammarRound | None = None  # per row; None: no row is under a grammar


@dataclass(frozen=True)
class ModeEvent:
    """The engine changed its mind about the mode mid-call (its rounds measured the chosen
    mode slower than another): from the next round on the call runs `mode`."""

    round_index: int  # the last round run in the old mode
    mode: str
    reason: str  # the whole story
    short: str  # one line for people


@dataclass(frozen=True)
class DraftLostEvent:
    """The call's drafter failed (its worker died or hung, its model ran out of memory):
    from round `round_index` on the rows take plain steps, which give exactly the tokens
    they would have got; a later call starts a new drafter."""

    round_index: int
    reason: str  # what failed, for people


@dataclass(frozen=True)
class SeatedEvent:
    """Serving (Engine.serve): a batch of rows starts, before its new rows' prompts are
    read. Row b serves request `requests[b]` (core.sequence.Request.id) until the next
    SeatedEvent: the row indices of later events refer to this seating. `joined`: the
    requests new in it (the others carry on from the previous seating)."""

    requests: tuple[int, ...]
    joined: tuple[int, ...]


@dataclass(frozen=True)
class SeatingDoneEvent:
    """Serving: the seating of the latest SeatedEvent ended (its rows re-seat or leave);
    `stats`: its metrics (core.stats snapshot), as a generate call's DoneEvent carries."""

    stats: Metrics


@dataclass(frozen=True)
class Output:
    """Final result for one row."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True)
class DoneEvent:
    """Generation finished for every row."""

    outputs: tuple[Output, ...]
    stats: Metrics  # the call's (core.metrics)


Event = (
    PrefillEvent | TokensEvent | RoundEvent | ModeEvent | DraftLostEvent | DoneEvent | SeatedEvent | SeatingDoneEvent
)
