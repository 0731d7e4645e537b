"""UI-free core of `ssdlocal race`: record AR, SD and SSD runs, replay them, summarize.

The modes cannot share this machine without slowing each other, so they run one after
another; each run records when every TokensEvent arrived, and the TUI (or the plain
table) replays / reports them with those measured timings. Each run also measures the
other load on the machine while it ran (load.py); a disturbed run is recorded again once
(`record_mode`), and a row still disturbed says so. What the race says beside its table
(exactness, hardware, auto's choice) is facts.py's. No Textual import here.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, Output, TokensEvent
from ssdlocal.core.metrics import Metrics
from ssdlocal.tui.core import EngineLike, OriginSplitter, Piece
from ssdlocal.tui.load import Disturbance, Meter, between, sample

RACE_MODES = (Mode.AR, Mode.SD, Mode.SSD)
RERUNS = 1  # times a mode whose run was disturbed by other load is recorded again


@dataclass
class RaceRun:
    """One mode's generation with the arrival time of each TokensEvent (s since start)."""

    mode: Mode
    times: list[float] = field(default_factory=list)
    pieces: list[list[Piece]] = field(default_factory=list)  # per event
    counts: list[int] = field(default_factory=list)  # tokens per event
    output: Output | None = None
    stats: Metrics | None = None  # the DoneEvent's (None: the call never ended)
    wall_s: float = 0.0  # generate call start -> DoneEvent
    load: Disturbance | None = None  # other processes' CPU while it ran
    dropped: tuple[Disturbance, ...] = ()  # earlier runs of this mode, dropped for being disturbed

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def shown(self, t: float) -> int:
        """Number of events that had arrived t seconds after the start."""
        return bisect_right(self.times, t)

    def tokens_at(self, t: float) -> int:
        return sum(self.counts[: self.shown(t)])

    def rate_at(self, t: float) -> float | None:
        """Decode tokens/s at time t (prefill excluded, as `tokens_per_s`)."""
        n = self.shown(t)
        if n < 2:
            return None
        end = self.times[-1] if n == len(self.times) else t
        span = end - self.times[0]
        return (sum(self.counts[1:n]) / span) if span > 0 else None

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] if self.times else None


def race_specs(base: SpecConfig, k: int | None = None, fan_out: tuple[int, ...] | None = None) -> list[SpecConfig]:
    """AR, SD and SSD variants of the engine's speculation settings (same K for SD/SSD);
    SSD left out for a draft that drafts in SD only (a draft head: `Draft.ssd`)."""
    k = k or base.k
    fan = fan_out if fan_out is not None else base.fan_out
    fan = fan if fan is not None and len(fan) == k + 1 else None
    modes = [m for m in RACE_MODES if m is not Mode.SSD or base.draft.ssd]
    return [replace(base, mode=m, k=k, fan_out=fan, fan_out_miss=None) for m in modes]


def record_run(
    engine: EngineLike,
    prompt_ids: list[int],
    params: SamplingParams,
    spec: SpecConfig,
    *,
    clock: Callable[[], float] = time.perf_counter,
    on_tokens: Callable[[int, list[Piece]], None] | None = None,
    cancel: CancelToken | None = None,
    meter: Meter = sample,
) -> RaceRun:
    """Generate once and record every TokensEvent with its arrival time, and the other
    load on the machine meanwhile (`meter`).

    `on_tokens(total_tokens, new_pieces)` is called after each TokensEvent (live progress).
    """
    run = RaceRun(spec.mode)
    splitter = OriginSplitter(engine.tokenizer)
    before = meter()
    start = clock()
    for event in engine.generate([prompt_ids], params, spec=spec, cancel=cancel):
        if isinstance(event, TokensEvent):
            run.times.append(clock() - start)
            run.pieces.append(splitter.split(event.token_ids, event.origins, event.text))
            run.counts.append(len(event.token_ids))
            if on_tokens is not None:
                on_tokens(run.tokens, run.pieces[-1])
        elif isinstance(event, DoneEvent):
            run.output = event.outputs[0]
            run.stats = event.stats
    run.wall_s = clock() - start
    run.load = between(before, meter())
    return run


def record_mode(
    engine: EngineLike,
    prompt_ids: list[int],
    params: SamplingParams,
    spec: SpecConfig,
    *,
    on_rerun: Callable[[Disturbance], None] | None = None,
    reruns: int = RERUNS,
    **record: Any,
) -> RaceRun:
    """record_run, again (up to `reruns` times) while other load disturbed the run;
    `on_rerun(disturbance)` is told before each new try. The last run is kept."""
    cancel = record.get("cancel")
    run = record_run(engine, prompt_ids, params, spec, **record)
    dropped: list[Disturbance] = []
    while run.load is not None and run.load.disturbed and len(dropped) < reruns and not (cancel and cancel.cancelled):
        dropped.append(run.load)
        if on_rerun is not None:
            on_rerun(run.load)
        run = record_run(engine, prompt_ids, params, spec, **record)
    run.dropped = tuple(dropped)
    return run


@dataclass(frozen=True)
class RaceRow:
    mode: str
    tokens: int
    wall_s: float
    ttft_s: float | None
    tokens_per_s: float | None
    speedup: float | None  # decode tokens/s over AR's
    acceptance_rate: float | None
    mean_accepted_len: float | None
    cache_hit_rate: float | None
    identical: bool | None  # same token ids as AR (None for AR itself)
    first_diff: int | None = None  # the first token that differs from AR's
    disturbed: str | None = None  # other load during its (last) run, when too much
    dropped: tuple[str, ...] = ()  # other load of earlier runs of the mode, dropped for it


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(runs: Sequence[RaceRun]) -> list[RaceRow]:
    ar = next((r for r in runs if r.mode is Mode.AR), None)
    ar_rate = ar.stats.tokens_per_s if ar and ar.stats else None
    rows = []
    for r in runs:
        s = r.stats or Metrics()
        rate = s.tokens_per_s
        same = diff = None
        if ar is not None and r is not ar and r.output and ar.output:
            diff = first_difference(r.output.token_ids, ar.output.token_ids)
            same = diff is None
        rows.append(
            RaceRow(
                mode=r.mode.value.upper(),
                tokens=r.tokens,
                wall_s=r.wall_s,
                ttft_s=r.stats.ttft_s if r.stats else r.ttft_s,
                tokens_per_s=rate,
                speedup=(rate / ar_rate) if rate and ar_rate else None,
                acceptance_rate=s.acceptance_rate,
                mean_accepted_len=s.mean_accepted_len,
                cache_hit_rate=s.cache_hit_rate,
                identical=same,
                first_diff=diff,
                disturbed=r.load.describe() if r.load is not None and r.load.disturbed else None,
                dropped=tuple(d.describe() for d in r.dropped),
            )
        )
    return rows


def identical_verdict(rows: Sequence[RaceRow], greedy: bool, cause: str = "") -> str:
    """One sentence about output equality (only expected token-for-token at T=0), naming
    the known cause (facts.divergence_cause) and the first token that differs."""
    checks = [r.identical for r in rows if r.identical is not None]
    if not checks:
        return ""
    if all(checks):
        return "same: identical output in every mode ✓"
    differ = ", ".join(f"{r.mode} from token {r.first_diff}" for r in rows if r.identical is False)
    if greedy:
        return f"same: output differs from AR in {differ} ✗ ({cause or 'see `ssdlocal check`'})"
    return f"same: outputs differ ({differ}): expected at T>0 — same distribution, different samples"


def timing_note(rows: Sequence[RaceRow]) -> str:
    """Whether other load disturbed the timings: which modes, how much, what was re-run."""
    parts = []
    for r in rows:
        if r.disturbed:
            again = " (on its re-run too)" if r.dropped else ""
            parts.append(f"{r.mode}* ran while {r.disturbed}{again}")
        elif r.dropped:
            parts.append(f"{r.mode} ran again: its first run shared the CPU ({r.dropped[0]})")
    if not parts:
        return "timings: no other load on the CPU during any mode"
    tail = ": a * speed, and speedups against it, are not this hardware's own" if any(r.disturbed for r in rows) else ""
    return "timings: " + "; ".join(parts) + tail


COLUMNS = (  # (header, what it means): short enough for one line of an 80-column table
    ("mode", ""),
    ("tokens", ""),
    ("tok/s", "decode speed"),
    ("vs AR", "tok/s over AR's"),
    ("TTFT", "time to the first token"),
    ("wall", "the whole call"),
    ("accept", "drafted tokens accepted"),
    ("tok/rnd", "tokens per target forward"),
    ("hits", "SSD cache hits"),
    ("same", "token for token AR's output"),
)


def summary_legend() -> str:
    """One line saying what the table's short headers mean."""
    return " · ".join(f"{name}: {what}" for name, what in COLUMNS if what)


def _seconds(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s"


def summary_table(rows: Sequence[RaceRow], title: str | None = None):
    """A rich Table of the race (the TUI summary and `race --no-tui`): every header and
    cell on one line of an 80-column terminal or pipe."""
    from rich import box
    from rich.table import Table

    def pct(x):
        return "–" if x is None else f"{x:.0%}"

    def num(x, fmt="{:.1f}"):
        return "–" if x is None else fmt.format(x)

    table = Table(
        title=title,
        expand=False,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    for name, _ in COLUMNS:
        table.add_column(name, justify="left" if name == "mode" else "right", no_wrap=True)
    for r in rows:
        same = "–" if r.identical is None else ("✓" if r.identical else "✗")
        table.add_row(
            r.mode + ("*" if r.disturbed else ""),
            str(r.tokens),
            num(r.tokens_per_s),
            num(r.speedup, "{:.2f}×"),
            _seconds(r.ttft_s),
            _seconds(r.wall_s),
            pct(r.acceptance_rate),
            num(r.mean_accepted_len, "{:.2f}"),
            pct(r.cache_hit_rate),
            same,
        )
    return table
