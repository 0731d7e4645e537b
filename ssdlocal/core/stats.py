"""SpecStats: counters for one generate call, and the metric snapshot with the shared metric names.

Owned by the engine, one instance per call (no globals). `snapshot()` returns a plain
dict with the metric names of docs/architecture.md §3 so JSON output, TUI and bench agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any


@dataclass
class SpecStats:
    """Accumulates per-round facts. Times are wall-clock seconds."""

    k: int = 0
    mode: str = ""  # the mode that ran
    mode_reason: str = ""  # why (one sentence)
    tokens: int = 0  # generated tokens, all rows
    rounds: int = 0  # target verifications after prefill
    row_rounds: int = 0  # (row, round) pairs: one per active row per round
    drafted: int = 0
    accepted: int = 0
    emitted_in_rounds: int = 0  # tokens committed by decode rounds (accepted + bonus)
    position_tried: list[int] = field(default_factory=list)  # [K]
    position_accepted: list[int] = field(default_factory=list)  # [K]
    accepted_len_hist: list[int] = field(default_factory=list)  # [K+1], per row-round
    draft_s: float = 0.0
    verify_s: float = 0.0
    # SSD
    ssd_rounds: int = 0
    cache_hits: int = 0
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    rows_hit: int = 0
    rows_miss: int = 0
    backup_used: dict[str, int] = field(default_factory=dict)
    draft_busy_s: float = 0.0
    # captured-step counts per model ("target", "draft"), as of now: set by the engine
    graphs_now: Callable[[], dict[str, dict]] | None = None
    start_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    end_time: float | None = None

    def __post_init__(self) -> None:
        self.position_tried = [0] * self.k
        self.position_accepted = [0] * self.k
        self.accepted_len_hist = [0] * (self.k + 1)

    def record_row(self, n_drafted: int, n_accepted: int, emitted: int) -> None:
        """One row's outcome in one round (emitted = committed tokens, after truncation)."""
        self.row_rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.emitted_in_rounds += emitted
        for i in range(min(n_drafted, self.k)):
            self.position_tried[i] += 1
            if i < n_accepted:
                self.position_accepted[i] += 1
        if n_drafted > 0:
            self.accepted_len_hist[min(n_accepted, self.k)] += 1

    def record_ssd_row(self, hit: bool, emitted: int) -> None:
        if hit:
            self.rows_hit += 1
            self.tokens_on_hit += emitted
        else:
            self.rows_miss += 1
            self.tokens_on_miss += emitted

    def mark_first_token(self) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def finish(self) -> None:
        self.end_time = time.perf_counter()

    def snapshot(self) -> dict[str, Any]:
        """The metric snapshot (docs/architecture.md §3 names); safe to call mid-generation."""
        now = self.end_time or time.perf_counter()
        ttft = None if self.first_token_time is None else self.first_token_time - self.start_time
        decode_s = 0.0 if self.first_token_time is None else now - self.first_token_time
        row_rounds = self.row_rounds
        decode_tokens = self.emitted_in_rounds
        out: dict[str, Any] = {
            "mode": self.mode,
            "mode_reason": self.mode_reason,
            "tokens": self.tokens,
            "tokens_per_s": (decode_tokens / decode_s) if decode_s > 0 else None,
            "ttft_s": ttft,
            "decode_s": decode_s,
            "rounds": self.rounds,
            "acceptance_rate": (self.accepted / self.drafted) if self.drafted else None,
            "mean_accepted_len": (decode_tokens / row_rounds) if row_rounds else None,
            "per_position_acceptance": [
                (a / t) if t else None for a, t in zip(self.position_accepted, self.position_tried)
            ],
            "accepted_len_hist": list(self.accepted_len_hist),
            "draft_ms": self.draft_s * 1e3,
            "verify_ms": self.verify_s * 1e3,
        }
        if self.graphs_now is not None:
            out["graphs"] = self.graphs_now()
        if self.ssd_rounds:
            rows = self.rows_hit + self.rows_miss
            out.update(
                {
                    "cache_hit_rate": (self.rows_hit / rows) if rows else None,
                    "round_hit_rate": self.cache_hits / self.ssd_rounds,
                    "tokens_per_round_hit": (self.tokens_on_hit / self.rows_hit)
                    if self.rows_hit
                    else None,
                    "tokens_per_round_miss": (self.tokens_on_miss / self.rows_miss)
                    if self.rows_miss
                    else None,
                    "backup_used": dict(self.backup_used),
                    "draft_busy_ms": self.draft_busy_s * 1e3,
                }
            )
        return out
