"""Typed speculation metrics: raw counts and the rates derived from them, with their names.

`Counts` holds raw counts only (one call's, or the sum of many with `+`: bench records, a
server's lifetime); `Metrics.of(counts)` derives the rates once (docs/architecture.md §3)
into a frozen record that every consumer reads by attribute. Feature parts are optional
sub-records (`adaptive`, `grammar`, `ssd`: None when the call had none of it). The JSON
names live here and only here: `Counts.as_dict` / `from_dict` (bench records),
`Metrics.to_dict` (`--json`, bench snapshots) and `Metrics.request_stats` (a server
answer's stats). core/stats.py fills the counts from engine events; this module knows no
events. Nobody multiplies a ratio back into a count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _plus(a, b):
    """One field of two counts summed: numbers add, lists element-wise (padded to the
    longer: calls with different K), dicts by key, optional parts as counts (None: none)."""
    if isinstance(a, list):
        n = max(len(a), len(b))
        return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
    if isinstance(a, dict):
        return {key: a.get(key, 0) + b.get(key, 0) for key in {**a, **b}}
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _sum(a, b, **fixed):
    """a + b field by field (`fixed`: fields not summed)."""
    return type(a)(
        **{f.name: _plus(getattr(a, f.name), getattr(b, f.name)) for f in fields(a) if f.name not in fixed}, **fixed
    )


def _json(value):
    return list(value) if isinstance(value, tuple | list) else dict(value) if isinstance(value, Mapping) else value


# ----------------------------------------------------------------------------- counts
@dataclass
class AdaptiveCounts:
    """Rounds of a drafter that chooses K and the source per round (draft/adaptive.py)."""

    width_rounds: dict[str, int] = field(default_factory=dict)  # K of the round (str: JSON keys) -> rounds
    source_rows: dict[str, int] = field(default_factory=dict)  # "model" | "suffix" | "none" -> row-rounds

    def __add__(self, other: AdaptiveCounts) -> AdaptiveCounts:
        return _sum(self, other)


@dataclass
class GrammarCounts:
    """Row-rounds under a grammar: their drafts, acceptances and grammar time."""

    row_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    mask_s: float = 0.0  # masks and walks along the proposals

    def __add__(self, other: GrammarCounts) -> GrammarCounts:
        return _sum(self, other)


@dataclass
class SsdCounts:
    """SSD rounds: speculation-cache hits and misses, the backups that served the misses,
    and the worker's compute."""

    rounds: int = 0
    hit_rounds: int = 0  # rounds where every row was served from the cache
    rows_hit: int = 0
    rows_miss: int = 0
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    busy_s: float = 0.0  # the worker's compute (pre-speculation + serving)
    backup_used: dict[str, int] = field(default_factory=dict)  # backup -> rounds with a miss it served

    def __add__(self, other: SsdCounts) -> SsdCounts:
        return _sum(self, other)


_PARTS = {"adaptive": AdaptiveCounts, "grammar": GrammarCounts, "ssd": SsdCounts}
# The bench's records keep counts flat: a part's fields under these JSON names.
_FLAT = {
    "ssd_rounds": ("ssd", "rounds"),
    "cache_hit_rounds": ("ssd", "hit_rounds"),
    "rows_hit": ("ssd", "rows_hit"),
    "rows_miss": ("ssd", "rows_miss"),
    "tokens_on_hit": ("ssd", "tokens_on_hit"),
    "tokens_on_miss": ("ssd", "tokens_on_miss"),
    "draft_busy_s": ("ssd", "busy_s"),
    "backup_used": ("ssd", "backup_used"),
    "constrained_row_rounds": ("grammar", "row_rounds"),
    "constrained_drafted": ("grammar", "drafted"),
    "constrained_accepted": ("grammar", "accepted"),
    "constrained_emitted": ("grammar", "emitted"),
    "mask_s": ("grammar", "mask_s"),
    "source_rows": ("adaptive", "source_rows"),
    "width_rounds": ("adaptive", "width_rounds"),
}
_RAN = {"ssd": "ssd_rounds", "grammar": "constrained_row_rounds", "adaptive": "source_rows"}  # the part ran when set


@dataclass
class Counts:
    """Raw counts of one call (or the sum of many with `+`); no ratios. Lists are per
    draft position (K entries; the histogram K+1); a feature part is None when its
    feature never ran."""

    k: int = 0
    tokens: int = 0  # every generated token
    decode_tokens: int = 0  # after each row's first (that one comes from the prefill)
    rounds: int = 0
    row_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # taken by decode rounds (accepted drafts + bonus, after stopping rules)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # first token to last
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # taken from the prefix cache (not read)
    draft_losses: int = 0  # drafters that failed mid-call (the rows went on with plain steps)
    position_tried: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    accepted_len_hist: list[int] = field(default_factory=list)
    adaptive: AdaptiveCounts | None = None
    grammar: GrammarCounts | None = None
    ssd: SsdCounts | None = None

    def __post_init__(self) -> None:
        for name, n in (("position_tried", self.k), ("position_accepted", self.k), ("accepted_len_hist", self.k + 1)):
            values = getattr(self, name)
            setattr(self, name, list(values) + [0] * (n - len(values)))

    def __add__(self, other: Counts) -> Counts:
        return _sum(self, other, k=max(self.k, other.k))

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON form (every name, zeros included), read back by `from_dict`."""
        out = {f.name: _json(getattr(self, f.name)) for f in fields(self) if f.name not in _PARTS}
        for name, (part, attr) in _FLAT.items():
            out[name] = _json(getattr(getattr(self, part) or _PARTS[part](), attr))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Counts:
        """`as_dict`'s form back (a missing name counts 0; a part exists when it ran)."""
        parts = {
            part: kind(**{attr: _json(d[name]) for name, (p, attr) in _FLAT.items() if p == part and name in d})
            for part, kind in _PARTS.items()
            if d.get(_RAN[part])
        }
        top = {f.name: _json(d[f.name]) for f in fields(cls) if f.name not in _PARTS and d.get(f.name) is not None}
        return cls(**top, **parts)


def new_counts(k: int) -> Counts:
    """Zero counts for lookahead K (`Counts(k=k)`)."""
    return Counts(k=k)


def add_counts(total: Counts, more: Counts) -> Counts:
    """total += more in place, for holders of one running total that others keep a
    reference to; returns total. Elsewhere write `total + more`."""
    summed = total + more
    for f in fields(total):
        setattr(total, f.name, getattr(summed, f.name))
    return total


# ----------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class AdaptiveMetrics:
    """K and the draft source chosen per round."""

    rounds_by_k: Mapping[int, int]
    mean_k: float | None
    rows_by_source: Mapping[str, int]

    @classmethod
    def of(cls, a: AdaptiveCounts, rounds: int) -> AdaptiveMetrics:
        widths = sorted((int(k), n) for k, n in a.width_rounds.items())
        return cls(dict(widths), _ratio(sum(k * n for k, n in widths), rounds), dict(a.source_rows))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class GrammarMetrics:
    """Rows under a grammar: grammar time per token they took, and their acceptance."""

    mask_ms_per_token: float | None
    constrained_acceptance_rate: float | None

    @classmethod
    def of(cls, g: GrammarCounts) -> GrammarMetrics:
        return cls(_ratio(g.mask_s * 1e3, g.emitted), _ratio(g.accepted, g.drafted))

    def to_dict(self) -> dict[str, Any]:
        return {
            "constrained": True,
            "mask_ms_per_token": self.mask_ms_per_token,
            "constrained_acceptance_rate": self.constrained_acceptance_rate,
        }


@dataclass(frozen=True)
class SsdMetrics:
    """SSD: cache hits per row-round and per round, tokens per row-round on a hit and on a
    miss, which backups served the misses, and the worker's compute."""

    cache_hit_rate: float | None
    round_hit_rate: float | None
    tokens_per_round_hit: float | None
    tokens_per_round_miss: float | None
    backup_used: Mapping[str, int]
    draft_busy_ms: float

    @classmethod
    def of(cls, s: SsdCounts) -> SsdMetrics:
        return cls(
            _ratio(s.rows_hit, s.rows_hit + s.rows_miss),
            _ratio(s.hit_rounds, s.rounds),
            _ratio(s.tokens_on_hit, s.rows_hit),
            _ratio(s.tokens_on_miss, s.rows_miss),
            dict(s.backup_used),
            s.busy_s * 1e3,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class Metrics:
    """The metrics of one call (or of summed counts): what the CLI, the TUI, the bench and
    the server show. Times in ms where named so; rates are None when nothing was counted.
    `graphs`, `prefix_cache` and `host_waits` are per model, in the JSON form of the
    module that counts them (backends' graph and prefix-cache stats, core.hostsync)."""

    mode: str = ""  # the mode that ran
    mode_reason: str = ""  # why (one sentence)
    ttft_s: float | None = None
    tokens: int = 0
    decode_tokens: int = 0
    tokens_per_s: float | None = None  # decode tokens / decode seconds (prefill excluded)
    decode_s: float = 0.0
    prefill_ms: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tokens_per_s: float | None = None  # prompt tokens read (not from the prefix cache) per second
    rounds: int = 0
    draft_losses: int = 0  # drafters that failed mid-call (core.events.DraftLostEvent)
    draft_lost: str | None = None  # why the last one failed
    acceptance_rate: float | None = None  # accepted / drafted
    mean_accepted_len: float | None = None  # tokens taken per row-round (accepted + bonus)
    per_position_acceptance: tuple[float | None, ...] = ()
    accepted_len_hist: tuple[int, ...] = ()
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    draft_ms_per_round: float | None = None
    verify_ms_per_round: float | None = None
    adaptive: AdaptiveMetrics | None = None
    grammar: GrammarMetrics | None = None
    ssd: SsdMetrics | None = None
    graphs: Mapping[str, Mapping[str, Any]] | None = None  # captured-step counts
    prefix_cache: Mapping[str, Mapping[str, Any]] | None = None
    host_waits: Mapping[str, Mapping[str, Any]] | None = None  # stream synchronisations, with per round

    @classmethod
    def of(cls, c: Counts, **call: Any) -> Metrics:
        """Counts -> rates; `call`: the call's own fields (mode, mode_reason, ttft_s, graphs, ...)."""
        return cls(
            tokens=c.tokens,
            decode_tokens=c.decode_tokens,
            tokens_per_s=_ratio(c.decode_tokens, c.decode_s),
            decode_s=c.decode_s,
            prefill_ms=c.prefill_s * 1e3,
            prompt_tokens=c.prompt_tokens,
            cached_prompt_tokens=c.cached_prompt_tokens,
            prefill_tokens_per_s=_ratio(c.prompt_tokens - c.cached_prompt_tokens, c.prefill_s),
            rounds=c.rounds,
            draft_losses=c.draft_losses,
            acceptance_rate=_ratio(c.accepted, c.drafted),
            mean_accepted_len=_ratio(c.emitted, c.row_rounds),
            per_position_acceptance=tuple(_ratio(a, t) for a, t in zip(c.position_accepted, c.position_tried)),
            accepted_len_hist=tuple(c.accepted_len_hist),
            draft_ms=c.draft_s * 1e3,
            verify_ms=c.verify_s * 1e3,
            draft_ms_per_round=_ratio(c.draft_s * 1e3, c.rounds),
            verify_ms_per_round=_ratio(c.verify_s * 1e3, c.rounds),
            adaptive=AdaptiveMetrics.of(c.adaptive, c.rounds) if c.adaptive else None,
            grammar=GrammarMetrics.of(c.grammar) if c.grammar else None,
            ssd=SsdMetrics.of(c.ssd) if c.ssd else None,
            **call,
        )

    @property
    def cache_hit_rate(self) -> float | None:
        """SSD's cache hits per row-round; None without SSD."""
        return self.ssd.cache_hit_rate if self.ssd else None

    @property
    def mean_k(self) -> float | None:
        """The adaptive drafter's mean K per round; None without one."""
        return self.adaptive.mean_k if self.adaptive else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (docs/architecture.md §3 names): feature parts flattened in when
        present, per-model parts under their own names."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("adaptive", "grammar", "ssd"):
                out.update(value.to_dict() if value is not None else {})
            elif f.name in ("graphs", "prefix_cache", "host_waits"):
                if value is not None:
                    out[f.name] = value
            else:
                out[f.name] = _json(value)
        return out

    def request_stats(self, *, batch_size: int, grammar: bool) -> dict[str, Any]:
        """A server answer's own stats in their JSON form (`ssdlocal` in the body): a subset
        of these metrics (counted over the request's rows; `ttft_s` from its arrival,
        `graphs` of the call that finished it), the most rows it shared a call with, and
        whether a grammar constrained it."""
        g = self.grammar
        return {
            "mode": self.mode,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_len": self.mean_accepted_len,
            "cache_hit_rate": self.cache_hit_rate,
            "tokens_per_s": self.tokens_per_s,
            "mean_k": self.mean_k,
            "rows_by_source": dict(self.adaptive.rows_by_source) if self.adaptive else None,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "ttft_s": self.ttft_s,
            "batch_size": batch_size,
            "constrained": grammar,
            **(
                {
                    "mask_ms_per_token": g.mask_ms_per_token if g else None,
                    "constrained_acceptance_rate": g.constrained_acceptance_rate if g else None,
                }
                if grammar
                else {}
            ),
            "graphs": self.graphs,
        }

    # Look-ups by JSON name, for callers that hold names (tests pinning them); the
    # product reads attributes (tests/test_stats.py checks).
    def __getitem__(self, name: str) -> Any:
        return self.to_dict()[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.to_dict().get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.to_dict()
