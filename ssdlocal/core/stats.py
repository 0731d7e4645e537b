"""Speculation metrics from engine events, computed one way for everyone.

`RunStats` consumes the events of one generate call (every row, or a subset: one server
request's rows) and keeps raw counts only; `metrics(counts)` turns counts (of one call, or
the sums of many: bench records, a server's lifetime, see `add_counts`) into the metric
names of docs/architecture.md §3. The engine, the CLI, the TUI, the server and the bench all
use these; nobody multiplies a ratio back into a count. Prefill and decode times are
separate from the start: `prefill_s` (the prompt's forward), `draft_s` and `verify_s`
(decode rounds only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ssdlocal.core.events import DoneEvent, PrefillEvent, RoundEvent, TokensEvent

ADDITIVE = (
    "tokens", "decode_tokens", "rounds", "row_rounds", "drafted", "accepted", "emitted",
    "ssd_rounds", "cache_hit_rounds", "rows_hit", "rows_miss", "tokens_on_hit", "tokens_on_miss",
    "prefill_s", "draft_s", "verify_s", "draft_busy_s", "decode_s", "prompt_tokens", "cached_prompt_tokens",
    "constrained_row_rounds", "constrained_drafted", "constrained_accepted", "constrained_emitted", "mask_s",
)  # fmt: skip
PER_POSITION = ("position_tried", "position_accepted", "accepted_len_hist")  # lists: K, K, K+1
BY_NAME = ("backup_used", "source_rows", "width_rounds")  # dicts of counts


def new_counts(k: int) -> dict[str, Any]:
    """Zero counts for lookahead K."""
    counts: dict[str, Any] = {name: 0 for name in ADDITIVE}
    counts.update(k=k, position_tried=[0] * k, position_accepted=[0] * k, accepted_len_hist=[0] * (k + 1))
    counts.update({name: {} for name in BY_NAME})
    return counts


def add_counts(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """total + more, in place (lists element-wise, padded to the longer; backups by name)."""
    for name in ADDITIVE:
        total[name] = total.get(name, 0) + more.get(name, 0)
    for name in PER_POSITION:
        a, b = total.get(name) or [], more.get(name) or []
        total[name] = [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))]
    for name in BY_NAME:
        into = total.setdefault(name, {})
        for key, n in (more.get(name) or {}).items():
            into[key] = into.get(key, 0) + n
    total["k"] = max(total.get("k", 0), more.get("k", 0))
    return total


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def metrics(c: dict[str, Any]) -> dict[str, Any]:
    """Raw counts -> the metric names (docs/architecture.md §3). Times in ms where named so."""
    out: dict[str, Any] = {
        "tokens": c["tokens"],
        "decode_tokens": c["decode_tokens"],
        "tokens_per_s": _ratio(c["decode_tokens"], c["decode_s"]),
        "decode_s": c["decode_s"],
        "prefill_ms": c["prefill_s"] * 1e3,
        "prompt_tokens": c["prompt_tokens"],
        "cached_prompt_tokens": c["cached_prompt_tokens"],
        # prompt tokens read (not taken from the prefix cache) per second of prefill
        "prefill_tokens_per_s": _ratio(c["prompt_tokens"] - c["cached_prompt_tokens"], c["prefill_s"]),
        "rounds": c["rounds"],
        "acceptance_rate": _ratio(c["accepted"], c["drafted"]),
        "mean_accepted_len": _ratio(c["emitted"], c["row_rounds"]),
        "per_position_acceptance": [_ratio(a, t) for a, t in zip(c["position_accepted"], c["position_tried"])],
        "accepted_len_hist": list(c["accepted_len_hist"]),
        "draft_ms": c["draft_s"] * 1e3,
        "verify_ms": c["verify_s"] * 1e3,
        "draft_ms_per_round": _ratio(c["draft_s"] * 1e3, c["rounds"]),
        "verify_ms_per_round": _ratio(c["verify_s"] * 1e3, c["rounds"]),
    }
    if c.get("source_rows"):  # an adaptive drafter: K and the source chosen per round
        out["rounds_by_k"] = {int(k): n for k, n in sorted(c["width_rounds"].items(), key=lambda kv: int(kv[0]))}
        out["mean_k"] = _ratio(sum(int(k) * n for k, n in c["width_rounds"].items()), c["rounds"])
        out["rows_by_source"] = dict(c["source_rows"])
    if c.get("constrained_row_rounds"):  # rows under a grammar
        out.update({
            "constrained": True,
            "mask_ms_per_token": _ratio(c["mask_s"] * 1e3, c["constrained_emitted"]),
            "constrained_acceptance_rate": _ratio(c["constrained_accepted"], c["constrained_drafted"]),
        })  # fmt: skip
    if c["ssd_rounds"]:
        out.update({
            "cache_hit_rate": _ratio(c["rows_hit"], c["rows_hit"] + c["rows_miss"]),
            "round_hit_rate": _ratio(c["cache_hit_rounds"], c["ssd_rounds"]),
            "tokens_per_round_hit": _ratio(c["tokens_on_hit"], c["rows_hit"]),
            "tokens_per_round_miss": _ratio(c["tokens_on_miss"], c["rows_miss"]),
            "backup_used": dict(c["backup_used"]),
            "draft_busy_ms": c["draft_busy_s"] * 1e3,
        })  # fmt: skip
    return out


@dataclass
class RunStats:
    """Counts of one generate call from its events; `rows` limits them to some rows."""

    k: int = 0
    mode: str = ""  # the mode that ran
    mode_reason: str = ""  # why (one sentence)
    rows: frozenset[int] | None = None  # None: every row
    started: float = field(default_factory=time.perf_counter)  # ttft is measured from here
    graphs_now: Callable[[], dict[str, dict]] | None = None  # captured-step counts per model
    prefix_now: Callable[[], dict[str, dict]] | None = None  # the prefix caches' counts per model
    host_waits_now: Callable[[], dict] | None = None  # core.hostsync.HostWaits per model, this call
    counts: dict[str, Any] = field(init=False)
    first_token_at: float | None = field(default=None, init=False)
    last_token_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.counts = new_counts(self.k)
        self._started_rows: set[int] = set()

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

    def _prefill(self, event: PrefillEvent) -> None:
        c = self.counts
        c["prefill_s"] += event.seconds
        mine = [b for b in range(len(event.prompt_tokens)) if self._mine(b)]
        c["prompt_tokens"] += sum(event.prompt_tokens[b] for b in mine)
        c["cached_prompt_tokens"] += sum(event.cached_tokens[b] for b in mine if b < len(event.cached_tokens))

    def _tokens(self, event: TokensEvent) -> None:
        c, n = self.counts, len(event.token_ids)
        c["tokens"] += n
        if event.row in self._started_rows:
            c["decode_tokens"] += n
        else:  # the row's first token (from the prefill): not decode work
            self._started_rows.add(event.row)
            c["decode_tokens"] += n - 1
            if self.first_token_at is None:
                self.first_token_at = event.at
        self.last_token_at = event.at
        c["decode_s"] = self.last_token_at - self.first_token_at

    def _round(self, event: RoundEvent) -> None:
        picked = [i for i, b in enumerate(event.rows) if self._mine(b)]
        if not picked:
            return
        c = self.counts
        c["rounds"] += 1
        c["draft_s"] += event.draft_s
        c["verify_s"] += event.verify_s
        c["draft_busy_s"] += event.draft_busy_s or 0.0
        if event.sources is not None:
            width = str(max(event.n_drafted[i] for i in picked))  # str keys: the counts go through JSON
            c["width_rounds"][width] = c["width_rounds"].get(width, 0) + 1
            for i in picked:
                c["source_rows"][event.sources[i]] = c["source_rows"].get(event.sources[i], 0) + 1
        for i in picked:
            self._row(event.n_drafted[i], event.n_accepted[i], event.n_emitted[i])
            if event.constrained is not None and event.constrained[i]:
                c["constrained_row_rounds"] += 1
                c["constrained_drafted"] += event.n_drafted[i]
                c["constrained_accepted"] += event.n_accepted[i]
                c["constrained_emitted"] += event.n_emitted[i]
                c["mask_s"] += event.mask_s[i]
        if event.cache_hit is not None:
            hits = [event.cache_hit[i] for i in picked]
            c["ssd_rounds"] += 1
            c["cache_hit_rounds"] += int(all(hits))
            for i, hit in zip(picked, hits):
                c["rows_hit" if hit else "rows_miss"] += 1
                c["tokens_on_hit" if hit else "tokens_on_miss"] += event.n_emitted[i]
            if event.backup and not all(hits):
                c["backup_used"][event.backup] = c["backup_used"].get(event.backup, 0) + 1

    def _row(self, n_drafted: int, n_accepted: int, emitted: int) -> None:
        """One row's outcome in one round (emitted = tokens it took, after stopping rules)."""
        c = self.counts
        c["row_rounds"] += 1
        c["drafted"] += n_drafted
        c["accepted"] += n_accepted
        c["emitted"] += emitted
        for i in range(min(n_drafted, c["k"])):
            c["position_tried"][i] += 1
            c["position_accepted"][i] += int(i < n_accepted)
        if n_drafted > 0:
            c["accepted_len_hist"][min(n_accepted, c["k"])] += 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def snapshot(self) -> dict[str, Any]:
        """The metric snapshot (docs/architecture.md §3 names); safe to call mid-generation."""
        out = {"mode": self.mode, "mode_reason": self.mode_reason, "ttft_s": self.ttft_s,
               **metrics(self.counts)}  # fmt: skip
        if self.graphs_now is not None:
            out["graphs"] = self.graphs_now()
        if self.prefix_now is not None:
            out["prefix_cache"] = self.prefix_now()
        if self.host_waits_now is not None:  # stream synchronisations per model, per round
            rounds = self.counts["rounds"]
            out["host_waits"] = {model: w.as_dict(rounds) for model, w in sorted(self.host_waits_now().items())}
        return out


def consume_all(stats: RunStats, events) -> DoneEvent | None:
    """Feed every event to `stats`; the DoneEvent, if the stream had one."""
    done = None
    for event in events:
        stats.consume(event)
        if isinstance(event, DoneEvent):
            done = event
    return done
