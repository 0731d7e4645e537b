"""One timed generation call of one system (our mode or a peer) over one batch of prompts.

`Measurement` is the common record every system returns; `from_engine_events` builds it
from an Engine event stream. Timing contract (docs/architecture.md §3): `ttft_s` is the
time to the first generated token, `decode_s` the time from there to the end, and
`decode_tokens` the generated tokens after each row's first one, so
tokens_per_s = decode_tokens / decode_s excludes prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ssdlocal.core.events import DoneEvent, Event, RoundEvent


@dataclass
class Measurement:
    system: str  # "ar" | "sd" | "ssd" | "hf" | "hf-assisted" | "llamacpp" | ...
    token_ids: list[list[int]]  # per row, generated tokens only
    finish: list[str]
    ttft_s: float | None
    decode_s: float
    decode_tokens: int
    spec: dict[str, Any] | None = None  # speculation counters (our SD/SSD modes)
    snapshot: dict[str, Any] = field(default_factory=dict)  # engine stats, as reported

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "token_ids": self.token_ids,
            "finish": self.finish,
            "tokens": sum(len(t) for t in self.token_ids),
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "decode_tokens": self.decode_tokens,
            "tokens_per_s": self.tokens_per_s,
            "spec": self.spec,
        }


def from_engine_events(system: str, events: Iterable[Event], k: int) -> Measurement:
    """Consume an Engine.generate stream; count speculation facts from its RoundEvents.

    Per-round draft/verify milliseconds exclude the first round, whose verify time
    includes prefill (the engine adds prefill to verify time).
    """
    drafted = accepted = row_rounds = rows_hit = rows_miss = 0
    first_snap: dict | None = None
    last_snap: dict | None = None
    done: DoneEvent | None = None
    for ev in events:
        if isinstance(ev, RoundEvent):
            drafted += sum(ev.n_drafted)
            accepted += sum(ev.n_accepted)
            row_rounds += len(ev.n_drafted)
            if ev.cache_hit is not None:
                rows_hit += sum(bool(h) for h in ev.cache_hit)
                rows_miss += sum(not h for h in ev.cache_hit)
            if first_snap is None:
                first_snap = ev.snapshot
            last_snap = ev.snapshot
        elif isinstance(ev, DoneEvent):
            done = ev
    if done is None:
        raise RuntimeError("engine stream ended without a DoneEvent")  # engine contract broken
    stats = done.stats
    batch = len(done.outputs)
    rounds = int(stats.get("rounds") or 0)
    spec = None
    if k > 0:
        timed = rounds - 1
        spec = {
            "k": k,
            "rounds": rounds,
            "row_rounds": row_rounds,
            "drafted": drafted,
            "accepted": accepted,
            "emitted": stats["tokens"] - batch,
            "accepted_len_hist": list(stats.get("accepted_len_hist") or []),
            "timed_rounds": max(timed, 0),
            "draft_ms_timed": (last_snap["draft_ms"] - first_snap["draft_ms"])
            if timed > 0
            else 0.0,
            "verify_ms_timed": (last_snap["verify_ms"] - first_snap["verify_ms"])
            if timed > 0
            else 0.0,
        }
        if stats.get("cache_hit_rate") is not None or rows_hit + rows_miss:
            spec.update(
                {
                    "rows_hit": rows_hit,
                    "rows_miss": rows_miss,
                    "tokens_on_hit": (stats.get("tokens_per_round_hit") or 0.0) * rows_hit,
                    "tokens_on_miss": (stats.get("tokens_per_round_miss") or 0.0) * rows_miss,
                    "backup_used": dict(stats.get("backup_used") or {}),
                    # the worker's compute per round (pre-speculation + serving), to set
                    # against the target's verify time: > verify means the draft is the bottleneck
                    "draft_busy_ms_timed": (
                        last_snap.get("draft_busy_ms", 0.0) - first_snap.get("draft_busy_ms", 0.0)
                    )
                    if timed > 0
                    else 0.0,
                }
            )
    elif rounds > 1 and first_snap is not None:  # AR: keep the per-step target latency
        spec = {
            "k": 0,
            "rounds": rounds,
            "timed_rounds": rounds - 1,
            "verify_ms_timed": last_snap["verify_ms"] - first_snap["verify_ms"],
            "draft_ms_timed": 0.0,
        }
    return Measurement(
        system=system,
        token_ids=[list(o.token_ids) for o in done.outputs],
        finish=[o.finish_reason for o in done.outputs],
        ttft_s=stats.get("ttft_s"),
        decode_s=float(stats.get("decode_s") or 0.0),
        decode_tokens=int(stats["tokens"]) - batch,
        spec=spec,
        snapshot={k_: v for k_, v in stats.items() if k_ != "per_position_acceptance"},
    )
