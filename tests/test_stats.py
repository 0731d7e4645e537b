"""Typed metrics (core/metrics.py, core/stats.py): counts add with `+`, the rates come out
of one frozen record, and the JSON edge keeps the names every output has always used.

The example call below is worked by hand (binary-exact times, so values compare exactly):
two rows, K=2, under SSD with an adaptive drafter and a grammar on row 0.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ssdlocal.core.events import (
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
    add_counts,
)
from ssdlocal.core.stats import RunStats

PACKAGE = Path(__file__).resolve().parent.parent / "ssdlocal"


def _example_call() -> RunStats:
    stats = RunStats(k=2, mode="ssd", mode_reason="asked for", started=0.0)
    events = [
        PrefillEvent(0.5, 2, prompt_tokens=(10, 6), cached_tokens=(4, 0)),
        TokensEvent(0, (1,), "a", at=1.0),  # each row's first token comes from the prefill
        TokensEvent(1, (2,), "b", at=1.0),
        RoundEvent(
            0,
            (2, 2),
            (2, 0),
            rows=(0, 1),
            n_emitted=(3, 1),
            draft_s=0.25,
            verify_s=0.5,
            sources=("model", "suffix"),
            ssd=SsdRound((True, False), "jit", 0.125),
            grammar=GrammarRound((True, False), (0.0625, 0.0)),
        ),
        TokensEvent(0, (3, 4, 5), "c", at=2.0),
        TokensEvent(1, (6,), "d", at=2.0),
        RoundEvent(
            1,
            (1,),
            (1,),
            rows=(0,),
            n_emitted=(2,),
            draft_s=0.5,
            verify_s=0.75,
            sources=("model",),
            ssd=SsdRound((True,), None, 0.25),
            grammar=GrammarRound((True,), (0.03125,)),
        ),
        TokensEvent(0, (7, 8), "e", at=3.0),
    ]
    for event in events:
        stats.consume(event)
    return stats


# The JSON form of the example, by hand: `--json`'s "stats", the bench's snapshots and the
# TUI all show these names (docs/architecture.md §3), in this order.
EXAMPLE_JSON = {
    "mode": "ssd",
    "mode_reason": "asked for",
    "ttft_s": 1.0,
    "tokens": 8,
    "decode_tokens": 6,
    "tokens_per_s": 3.0,
    "decode_s": 2.0,
    "prefill_ms": 500.0,
    "prompt_tokens": 16,
    "cached_prompt_tokens": 4,
    "prefill_tokens_per_s": 24.0,
    "rounds": 2,
    "draft_losses": 0,
    "draft_lost": None,
    "acceptance_rate": 3 / 5,
    "mean_accepted_len": 2.0,
    "per_position_acceptance": [2 / 3, 1 / 2],
    "accepted_len_hist": [1, 1, 1],
    "draft_ms": 750.0,
    "verify_ms": 1250.0,
    "draft_ms_per_round": 375.0,
    "verify_ms_per_round": 625.0,
    "rounds_by_k": {1: 1, 2: 1},
    "mean_k": 1.5,
    "rows_by_source": {"model": 2, "suffix": 1},
    "constrained": True,
    "mask_ms_per_token": 18.75,
    "constrained_acceptance_rate": 1.0,
    "cache_hit_rate": 2 / 3,
    "round_hit_rate": 0.5,
    "tokens_per_round_hit": 2.5,
    "tokens_per_round_miss": 1.0,
    "backup_used": {"jit": 1},
    "draft_busy_ms": 375.0,
}


def test_metrics_record_reads_by_attribute_and_its_dict_keeps_the_names():
    m = _example_call().snapshot()
    assert m.acceptance_rate == 3 / 5 and m.mean_accepted_len == 2.0 and m.tokens_per_s == 3.0
    assert m.ssd.cache_hit_rate == m.cache_hit_rate == 2 / 3 and m.ssd.backup_used == {"jit": 1}
    assert m.grammar.mask_ms_per_token == 18.75 and m.adaptive.mean_k == m.mean_k == 1.5
    d = m.to_dict()
    assert list(d) == list(EXAMPLE_JSON) and d == EXAMPLE_JSON
    assert json.loads(json.dumps(d))["rounds_by_k"] == {"1": 1, "2": 1}  # JSON keys are strings
    with pytest.raises(AttributeError):
        m.tokens = 0  # frozen: a snapshot never changes under its reader


def test_feature_parts_are_absent_when_the_call_had_none():
    stats = RunStats(k=2)
    stats.consume(RoundEvent(0, (2,), (1,), rows=(0,), n_emitted=(2,)))
    m = stats.snapshot()
    assert m.ssd is None and m.grammar is None and m.adaptive is None and m.cache_hit_rate is None
    assert not {"cache_hit_rate", "constrained", "mean_k", "graphs", "host_waits"} & set(m.to_dict())
    assert Metrics().to_dict()["acceptance_rate"] is None  # nothing drafted: no rate, not 0
    assert "cache_hit_rate" not in m and "acceptance_rate" in m and m["rounds"] == 1 == m.get("rounds")


def test_counts_add_field_by_field():
    a = Counts(
        k=2,
        tokens=3,
        drafted=4,
        accepted=2,
        position_tried=[2, 1],
        position_accepted=[1, 1],
        accepted_len_hist=[1, 0, 1],
        ssd=SsdCounts(rounds=2, rows_hit=1, rows_miss=1, backup_used={"jit": 1}),
        adaptive=AdaptiveCounts({"2": 1}, {"model": 1}),
    )
    b = Counts(
        k=3,
        tokens=5,
        drafted=3,
        accepted=3,
        position_tried=[1, 1, 1],
        position_accepted=[1, 1, 1],
        accepted_len_hist=[0, 0, 0, 1],
        ssd=SsdCounts(rounds=1, rows_hit=1, backup_used={"jit": 2, "ngram": 1}),
        grammar=GrammarCounts(row_rounds=1, drafted=3, accepted=3, emitted=4, mask_s=0.5),
    )
    total = a + b
    assert total == Counts(
        k=3,
        tokens=8,
        drafted=7,
        accepted=5,
        position_tried=[3, 2, 1],
        position_accepted=[2, 2, 1],
        accepted_len_hist=[1, 0, 1, 1],
        ssd=SsdCounts(rounds=3, rows_hit=2, rows_miss=1, backup_used={"jit": 3, "ngram": 1}),
        grammar=GrammarCounts(row_rounds=1, drafted=3, accepted=3, emitted=4, mask_s=0.5),
        adaptive=AdaptiveCounts({"2": 1}, {"model": 1}),
    )
    assert a.tokens == 3 and a.ssd.backup_used == {"jit": 1} and b.grammar.row_rounds == 1  # operands unchanged
    assert Counts(k=2) + Counts() == Counts(k=2)  # zero is neutral, K the larger
    assert sum([a, b], Counts()) == total
    held = Counts()
    assert add_counts(held, a) is held and held == a  # in place, for totals others hold


def test_counts_json_form_round_trips_and_reads_partial_records():
    c = _example_call().counts
    flat = json.loads(json.dumps(c.as_dict()))
    assert Counts.from_dict(flat) == c
    assert set(flat) == {
        "tokens",
        "decode_tokens",
        "rounds",
        "row_rounds",
        "drafted",
        "accepted",
        "emitted",
        "ssd_rounds",
        "cache_hit_rounds",
        "rows_hit",
        "rows_miss",
        "tokens_on_hit",
        "tokens_on_miss",
        "prefill_s",
        "draft_s",
        "verify_s",
        "draft_busy_s",
        "decode_s",
        "prompt_tokens",
        "cached_prompt_tokens",
        "draft_losses",
        "constrained_row_rounds",
        "constrained_drafted",
        "constrained_accepted",
        "constrained_emitted",
        "mask_s",
        "k",
        "position_tried",
        "position_accepted",
        "accepted_len_hist",
        "backup_used",
        "source_rows",
        "width_rounds",
    }  # the bench records' names
    old = Counts.from_dict({"k": 2, "rounds": 1, "drafted": 2, "accepted": 1, "ssd_rounds": 1, "rows_miss": 1})
    assert old.ssd == SsdCounts(rounds=1, rows_miss=1) and old.grammar is None and old.position_tried == [0, 0]
    assert Counts.from_dict(Counts(k=3).as_dict()) == Counts(k=3)  # no feature ran: no parts


def test_request_stats_are_one_list_owned_by_the_metrics():
    m = Metrics.of(_example_call().counts, mode="ssd", ttft_s=0.25, graphs={"target": {"replays": 3}})
    plain = m.request_stats(batch_size=2, grammar=False)
    assert list(plain) == [
        "mode",
        "acceptance_rate",
        "mean_accepted_len",
        "cache_hit_rate",
        "tokens_per_s",
        "mean_k",
        "rows_by_source",
        "prompt_tokens",
        "cached_prompt_tokens",
        "prefill_tokens_per_s",
        "ttft_s",
        "batch_size",
        "constrained",
        "graphs",
    ]
    assert (
        plain["cache_hit_rate"] == 2 / 3 and plain["ttft_s"] == 0.25 and plain["graphs"] == {"target": {"replays": 3}}
    )
    constrained = m.request_stats(batch_size=2, grammar=True)
    assert list(constrained)[-3:] == ["mask_ms_per_token", "constrained_acceptance_rate", "graphs"]
    assert constrained["mask_ms_per_token"] == 18.75 and constrained["constrained"] is True
    ar = Metrics.of(Counts(), mode="ar").request_stats(batch_size=1, grammar=True)
    assert ar["cache_hit_rate"] is None and ar["mean_k"] is None and ar["mask_ms_per_token"] is None


# Modules that show or pass on an engine call's metrics. They read Metrics attributes;
# a metric looked up by name (x["name"], x.get("name")) means a second list of names.
CONSUMERS = (
    "cli/render.py",
    "cli/generate.py",
    "tui",
    "engine",
    "core/stats.py",
    "bench/measure.py",
    "bench/check.py",
    "server/metrics.py",
    "server/responses.py",
)
BY_NAME_ALLOWED = {
    ("server/metrics.py", "ttft_s"),  # record_job reads the answer's stats JSON (server/scheduler.py's Finished)
}


GENERIC = {"tokens", "mode", "k"}  # also other records' keys (a logprobs block's "tokens")


def _metric_names() -> set[str]:
    full = Counts(k=1, adaptive=AdaptiveCounts({"1": 1}, {"model": 1}), grammar=GrammarCounts(1), ssd=SsdCounts(1))
    m = Metrics.of(full, graphs={}, prefix_cache={}, host_waits={})
    return (set(m.to_dict()) | set(full.as_dict()) | set(m.request_stats(batch_size=1, grammar=True))) - GENERIC


def _looked_up_by_name(path: Path, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        if key in names:
            found.add(key)
    return found


def test_consumers_read_metrics_by_attribute_not_by_name():
    names = _metric_names()
    assert {"acceptance_rate", "cache_hit_rate", "tokens_per_s", "ttft_s", "rows_hit"} <= names
    offenders = []
    for entry in CONSUMERS:
        paths = sorted((PACKAGE / entry).rglob("*.py")) if (PACKAGE / entry).is_dir() else [PACKAGE / entry]
        assert paths and all(p.exists() for p in paths), entry
        for path in paths:
            rel = path.relative_to(PACKAGE).as_posix()
            offenders += [(rel, key) for key in _looked_up_by_name(path, names) if (rel, key) not in BY_NAME_ALLOWED]
    assert not offenders, f"metrics looked up by name (read the core.metrics.Metrics attribute): {sorted(offenders)}"
