"""Engine events -> counts, one way for everyone (the engine, the CLI, the TUI, the server, the bench).

`RunStats` consumes the events of one generate call (every row, or a subset: one server
request's rows) into core.metrics.Counts; `snapshot()` is the call's core.metrics.Metrics
so far. Prefill and decode times are separate from the start: `prefill_s` (the prompt's
forward), `draft_s` and `verify_s` (decode rounds only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ssdlocal.core.events import (
    DoneEvent,
    DraftLostEvent,
    GrammarRound,
    PrefillEvent,
    RoundEvent,
    SsdRound,
    TokensEvent,
)
from ssdlocal.core.metrics import (
    AdaptiveCounts,
    Counts,
    GrammarCounts,
    Metrics,
    SsdCounts,
)


class StatsSources(Protocol):
    """What a call's metrics report beyond its events, per model ("target", "draft",
    "worker"), read when a snapshot is taken: the engine's runners and drafter answer."""

    def graphs(self) -> dict[str, dict]:
        """Captured-step counts of this call."""

    def prefix(self) -> dict[str, dict]:
        """The prefix caches' sizes and counts now."""

    def host_waits(self) -> dict:
        """core.hostsync.HostWaits of this call."""


@dataclass
class RunStats:
    """Counts of one generate call from its events; `rows` limits them to some rows;
    `sources` (None: none) answers what the events do not carry."""

    k: int = 0
    mode: str = ""  # the mode that ran
    mode_reason: str = ""  # why (one sentence)
    rows: frozenset[int] | None = None  # None: every row
    started: float = field(default_factory=time.perf_counter)  # ttft is measured from here
    sources: StatsSources | None = None
    counts: Counts = field(init=False)
    first_token_at: float | None = field(default=None, init=False)
    last_token_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.counts = Counts(k=self.k)
        self._started_rows: set[int] = set()
        self.draft_lost: str | None = None  # why the call's drafter failed, if it did

    def _mine(self, row: int) -> bool:
        return self.rows is None or row in self.rows

    def consume(self, event) -> None:
        """Count one engine event (others are ignored)."""
        if isinstance(event, PrefillEvent):
            self._prefill(event)
        elif isinstance(event, TokensEvent) and self._mine(event.row):
            self._tokens(event)
        elif isinstance(event, RoundEvent):
            self._round(event)
        elif isinstance(event, DraftLostEvent):
            self.counts.draft_losses += 1
            self.draft_lost = event.reason

    def _prefill(self, event: PrefillEvent) -> None:
        c = self.counts
        c.prefill_s += event.seconds
        mine = [b for b in range(len(event.prompt_tokens)) if self._mine(b)]
        c.prompt_tokens += sum(event.prompt_tokens[b] for b in mine)
        c.cached_prompt_tokens += sum(event.cached_tokens[b] for b in mine if b < len(event.cached_tokens))

    def _tokens(self, event: TokensEvent) -> None:
        c, n = self.counts, len(event.token_ids)
        c.tokens += n
        if event.row in self._started_rows:
            c.decode_tokens += n
        else:  # the row's first token (from the prefill): not decode work
            self._started_rows.add(event.row)
            c.decode_tokens += n - 1
            if self.first_token_at is None:
                self.first_token_at = event.at
        self.last_token_at = event.at
        assert self.first_token_at is not None  # set by the first row's first token, which came first
        c.decode_s = self.last_token_at - self.first_token_at

    def _round(self, event: RoundEvent) -> None:
        picked = [i for i, b in enumerate(event.rows) if self._mine(b)]
        if not picked:
            return
        c = self.counts
        c.rounds += 1
        c.draft_s += event.draft_s
        c.verify_s += event.verify_s
        if event.sources is not None:
            a = c.adaptive = c.adaptive or AdaptiveCounts()
            width = str(max(event.n_drafted[i] for i in picked))  # str keys: the counts go through JSON
            a.width_rounds[width] = a.width_rounds.get(width, 0) + 1
            for i in picked:
                a.source_rows[event.sources[i]] = a.source_rows.get(event.sources[i], 0) + 1
        for i in picked:
            self._row(event.n_drafted[i], event.n_accepted[i], event.n_emitted[i])
        if event.grammar is not None:
            self._grammar(event, event.grammar, picked)
        if event.ssd is not None:
            self._ssd(event, event.ssd, picked)

    def _row(self, n_drafted: int, n_accepted: int, emitted: int) -> None:
        """One row's outcome in one round (emitted = tokens it took, after stopping rules)."""
        c = self.counts
        c.row_rounds += 1
        c.drafted += n_drafted
        c.accepted += n_accepted
        c.emitted += emitted
        for i in range(min(n_drafted, c.k)):
            c.position_tried[i] += 1
            c.position_accepted[i] += int(i < n_accepted)
        if n_drafted > 0:
            c.accepted_len_hist[min(n_accepted, c.k)] += 1

    def _grammar(self, event: RoundEvent, part: GrammarRound, picked: list[int]) -> None:
        """Count the picked rows' grammar-constrained outcomes; `part` is `event.grammar`."""
        for i in (i for i in picked if part.constrained[i]):
            g = self.counts.grammar = self.counts.grammar or GrammarCounts()
            g.row_rounds += 1
            g.drafted += event.n_drafted[i]
            g.accepted += event.n_accepted[i]
            g.emitted += event.n_emitted[i]
            g.mask_s += part.mask_s[i]

    def _ssd(self, event: RoundEvent, part: SsdRound, picked: list[int]) -> None:
        """Count the picked rows' speculation-cache hits and misses; `part` is `event.ssd`."""
        s = self.counts.ssd = self.counts.ssd or SsdCounts()
        hits = [part.cache_hit[i] for i in picked]
        s.rounds += 1
        s.hit_rounds += int(all(hits))
        s.busy_s += part.busy_s or 0.0
        for i, hit in zip(picked, hits):
            if hit:
                s.rows_hit += 1
                s.tokens_on_hit += event.n_emitted[i]
            else:
                s.rows_miss += 1
                s.tokens_on_miss += event.n_emitted[i]
        if part.backup and not all(hits):
            s.backup_used[part.backup] = s.backup_used.get(part.backup, 0) + 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def snapshot(self) -> Metrics:
        """The call's metrics so far; safe to call mid-generation."""
        sources, host_waits = self.sources, None
        if sources is not None:  # stream synchronisations per model, per round
            rounds = self.counts.rounds
            host_waits = {model: w.as_dict(rounds) for model, w in sorted(sources.host_waits().items())}
        return Metrics.of(
            self.counts,
            mode=self.mode,
            mode_reason=self.mode_reason,
            draft_lost=self.draft_lost,
            ttft_s=self.ttft_s,
            graphs=sources.graphs() if sources is not None else None,
            prefix_cache=sources.prefix() if sources is not None else None,
            host_waits=host_waits,
        )


def consume_all(stats: RunStats, events) -> DoneEvent | None:
    """Feed every event to `stats`; the DoneEvent, if the stream had one."""
    done = None
    for event in events:
        stats.consume(event)
        if isinstance(event, DoneEvent):
            done = event
    return done
