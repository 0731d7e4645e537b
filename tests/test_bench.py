"""`ssdlocal bench` on the tiny checkpoints: results.json schema and aggregate math,
Markdown and PNG written, exactness failures flagged with a margin, prompt loading,
projection math against hand-computed values, and the transformers peers.

Torch runs one thread in this process (the SSD worker is not pinned: --no-pin), as in
test_engine_exact.py, so the two processes do not oversubscribe the cores.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.cli import run_cli

from ssdlocal.bench import run as bench_run
from ssdlocal.bench.aggregate import aggregate, aggregate_all
from ssdlocal.bench.exactness import check_exactness, divergence_index, logit_margin
from ssdlocal.speculation.projection import ProjectionInputs, project, sd_speedup, ssd_speedup
from ssdlocal.bench.prompts import BenchPrompt, load_prompts, select
from ssdlocal.bench.report import build_results, write_all
from ssdlocal.cli.app import main
from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import UsageError
from ssdlocal.core.config import ModelDraft

MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_args(tiny_dir, *extra) -> list:
    return [
        "bench",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        MAX_NEW,
        "--no-chat",
        "--no-pin",
        "--ignore-eos",
        *extra,
    ]


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def full_run(tiny_dir, tmp_path_factory):
    """One CLI run: AR, SD, SSD and both transformers peers on 3 prompts, with --project."""
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setattr(
        sys,
        "argv",
        [
            "ssdlocal",
            *map(
                str,
                tiny_args(
                    tiny_dir,
                    "--limit",
                    3,
                    "--peers",
                    "hf,hf-assisted,llamacpp",
                    "--project",
                    "--out",
                    out,
                    "--k",
                    4,
                ),
            ),
        ],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    mp.undo()
    assert not exit_info.value.code
    return out, json.loads((out / "results.json").read_text())


def test_results_json_schema(full_run):
    _, doc = full_run
    for key in (
        "hardware",
        "versions",
        "settings",
        "prompts",
        "records",
        "aggregates",
        "exactness",
        "projections",
    ):
        assert key in doc
    assert {"cpu", "cores", "cpu_isa", "cpu_bf16", "ram_gib", "gpus"} <= set(doc["hardware"])
    assert {"ssdlocal", "torch", "transformers", "python"} <= set(doc["versions"])
    assert doc["systems"] == ["ar", "sd", "ssd", "hf", "hf-assisted"]
    # llama.cpp peers are skipped either way: the extra is missing, or no GGUF was given
    import importlib.util

    have_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    reason = "pass --gguf-target" if have_llamacpp else "not installed"
    assert reason in doc["skipped"]["llamacpp"]
    kinds = {p["kind"] for p in doc["prompts"]}
    assert len(kinds) == 3  # round-robin over kinds: code, math, instruction
    assert len(doc["records"]) == 3 * 5
    # interleaved with a rotating order: each system runs first on a different prompt
    firsts = [r["system"] for r in doc["records"] if r["order"] == 0]
    assert len(set(firsts)) == 3
    for rec in doc["records"]:
        assert len(rec["token_ids"][0]) == MAX_NEW
        assert rec["decode_tokens"] == MAX_NEW - 1 or rec["system"] == "hf-assisted"
        assert rec["ttft_s"] > 0 and rec["decode_s"] > 0


def test_aggregates_follow_the_records(full_run):
    _, doc = full_run
    for name, agg in doc["aggregates"].items():
        recs = [r for r in doc["records"] if r["system"] == name]
        tokens = sum(r["decode_tokens"] for r in recs)
        seconds = sum(r["decode_s"] for r in recs)
        assert agg["tokens_per_s"] == pytest.approx(tokens / seconds)
        assert agg["tokens_per_s_mean"] == pytest.approx(sum(r["tokens_per_s"] for r in recs) / len(recs))
        assert agg["exactness"] in ("reference", "exact")  # fp32, temperature 0
    aggs = doc["aggregates"]
    assert aggs["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert aggs["ssd"]["speedup_vs_sd"] == pytest.approx(aggs["ssd"]["tokens_per_s"] / aggs["sd"]["tokens_per_s"])
    for mode in ("sd", "ssd"):
        a = aggs[mode]
        assert 0.0 <= a["acceptance_rate"] <= 1.0
        assert a["accepted"] == sum(i * n for i, n in enumerate(a["accepted_len_hist"]))
        assert len(a["accepted_len_hist"]) == 5  # K = 4
        assert 1.0 <= a["mean_accepted_len"] <= 5.0
    assert 0.0 <= aggs["ssd"]["cache_hit_rate"] <= 1.0
    assert aggs["ssd"]["draft_busy_ms_per_round"] > 0.0  # the worker reports its compute
    assert "cache_hit_rate" not in aggs["sd"]
    rows = doc["projections"]["rows"]
    assert [r["ratio"] for r in rows][:5] == [0.02, 0.05, 0.1, 0.2, 0.35] or any(r["measured"] for r in rows)
    assert "projection" in doc["projections"]["label"]


def test_markdown_png_and_summary(full_run):
    out, _ = full_run
    md = (out / "results.md").read_text()
    assert "| system | tok/s" in md and "| ssd |" in md and "| hf-assisted |" in md and "Projection" in md
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_exactness_failure_is_flagged_with_margin(tiny_dir, monkeypatch, tmp_path):
    """A mode whose tokens differ from AR's fails (no speedup), with index and margin."""
    real = bench_run.from_engine_events

    def corrupt_sd(system, events, k):
        m = real(system, events, k)
        if system == "sd" and len(m.token_ids[0]) > 3:
            m.token_ids[0][3] = (m.token_ids[0][3] + 1) % 300
        return m

    monkeypatch.setattr(bench_run, "from_engine_events", corrupt_sd)
    settings = bench_run.BenchSettings(modes=("ar", "sd"), chat=False)
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=4, draft=ModelDraft(ModelSpec(str(tiny_dir["draft_llama"]), dtype="float32"))),
        pin_cpus=False,
    )
    prompts = [BenchPrompt("a", "code", "def foo(x):"), BenchPrompt("b", "chat", "The cat sat")]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    run = bench_run.run_bench(config, prompts, settings, params)
    ex = run.exactness["sd"]
    assert ex["status"] == "FAIL" and ex["mismatched_rows"] == 2
    div = ex["divergences"][0]
    assert div["index"] == 3 and div["margin"] >= 0.0 and div["top1_id"] == div["ar_token"]
    assert isinstance(div["near_tie"], bool)
    doc = build_results(
        run,
        with_projection=False,
        env={
            "hardware": {"cpu": "x", "usable_cores": 1, "ram_gib": 1, "gpus": []},
            "versions": {"ssdlocal": "0", "torch": "0", "transformers": "0", "python": "3"},
        },
    )
    sd = doc["aggregates"]["sd"]
    assert not sd["valid"] and sd["speedup_vs_ar"] is None
    paths = write_all(doc, tmp_path)
    assert "FAIL 2/2 (first at 3, margin" in paths["md"].read_text()
    assert doc["settings"]["target_backend"] == "torch" and "near-tie" not in paths["md"].read_text()


def test_llamacpp_near_ties_get_a_note_that_names_batch_invariant():
    """On a llama.cpp target without --batch-invariant, failures whose divergences all sit
    at near-ties within llama.cpp's call-width rounding are explained under the table;
    a larger margin, another backend, or the option on: no note (the FAIL stands alone)."""
    from ssdlocal.bench.report import exactness_note

    def doc(backend="llamacpp", invariant=False, margins=(0.12, 0.5)):
        divs = [{"index": 3, "margin": m} for m in margins]
        return {
            "settings": {"target_backend": backend, "batch_invariant": invariant},
            "exactness": {"ar": {"status": "reference"}, "auto": {"status": "FAIL", "divergences": divs}},
        }

    note = exactness_note(doc())
    assert note is not None and "0.120-0.500" in note and "--batch-invariant" in note
    assert exactness_note(doc(margins=(0.12, 2.5))) is None  # no rounding: a bug until shown otherwise
    assert exactness_note(doc(margins=(0.12, None))) is None
    assert exactness_note(doc(backend="torch")) is None
    assert exactness_note(doc(invariant=True)) is None
    assert exactness_note(doc(margins=())) is None


def test_results_are_written_without_matplotlib(tmp_path, monkeypatch):
    """matplotlib is the optional `bench` extra: without it the JSON and Markdown are
    still written (a run is never lost to the plot) and no results.png is claimed."""
    import builtins

    from ssdlocal.bench import report

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(report, "plotting_available", lambda: False)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    doc = {"aggregates": {}, "environment": {}, "settings": {}, "records": []}
    monkeypatch.setattr(report, "markdown", lambda d: "table\n")
    paths = write_all(doc, tmp_path)
    assert set(paths) == {"json", "md"} and not (tmp_path / "results.png").exists()
    assert paths["json"].is_file() and paths["md"].read_text() == "table\n"


def test_check_exactness_pure():
    records = [
        {"system": "ar", "prompt_ids": ["a"], "token_ids": [[1, 2, 3]]},
        {"system": "sd", "prompt_ids": ["a"], "token_ids": [[1, 2, 3]]},
        {"system": "ssd", "prompt_ids": ["a"], "token_ids": [[1, 9, 3]]},
    ]
    calls = []
    result = check_exactness(records, {"a": [7]}, lambda p, pre, toks: calls.append((p, pre, toks)) or {"margin": 0.5})
    assert result["sd"]["status"] == "exact" and result["ssd"]["status"] == "FAIL"
    assert result["ssd"]["divergences"][0] == {
        "prompt_id": "a",
        "index": 1,
        "ar_token": 2,
        "token": 9,
        "margin": 0.5,
    }
    assert calls == [([7], [1], [2, 9])]
    assert divergence_index([1, 2], [1, 2, 3]) == 2 and divergence_index([1], [1]) is None


# ----------------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--modes", "ar,turbo"], "bad --modes"),
        (["--peers", "vllm"], "unknown peer 'vllm'"),
        (["--batch-size", "0"], "batch-size must be >= 1"),
        (["--limit", "0"], "limit must be >= 1"),
        (["--prompts", "/nonexistent/prompts.txt"], "prompt file not found"),
    ],
)
def test_bench_usage_errors(monkeypatch, capsys, tiny_dir, extra, needle):
    code, _, err = run_cli(monkeypatch, capsys, *tiny_args(tiny_dir, *extra))
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: {needle}") and "hint: " in err, err


# ----------------------------------------------------------------------------- prompts
def test_prompt_files(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"id": "x1", "kind": "code", "prompt": "def f():"}\n\n{"prompt": "hi"}\n')
    got = load_prompts(jl)
    assert got[0] == BenchPrompt("x1", "code", "def f():") and got[1].prompt == "hi"
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [p.prompt for p in load_prompts(txt)] == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(UsageError, match="prompt"):
        load_prompts(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_prompts(broken)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(UsageError, match="no prompts"):
        load_prompts(empty)
    with pytest.raises(UsageError) as info:
        load_prompts(tmp_path / "missing.txt")
    assert info.value.hint


def test_default_set_round_robin():
    prompts = load_prompts()
    assert len(prompts) >= 20
    four = select(prompts, 4)
    assert [p.kind for p in four] == ["code", "math", "instruction", "chat"]
    assert len(select(prompts, None)) == len(prompts)


# ----------------------------------------------------------------------------- math
def test_projection_math_by_hand():
    assert sd_speedup(3.0, 4, 0.1) == pytest.approx(3.0 / 1.4)
    # p=0.5, E_hit=3, E_miss=2, K=4, r=0.1, jit backup (4 forwards): T_p=0.5, T_b=0.4
    assert ssd_speedup(0.5, 3.0, 2.0, 4, 0.1, 4) == pytest.approx(2.5 / (0.5 * 1.0 + 0.5 * 1.4))
    # r=0.35: T_p=1.75 exceeds one verification
    assert ssd_speedup(0.5, 3.0, 2.0, 4, 0.35, 4) == pytest.approx(2.5 / (0.5 * 1.75 + 0.5 * 2.4))
    # all hits, free drafting: the speedup is E_hit
    assert ssd_speedup(1.0, 3.0, 2.0, 4, 0.0, 4) == pytest.approx(3.0)
    proj = project(
        ProjectionInputs(k=4, e_sd=3.0, p_hit=0.5, e_hit=3.0, e_miss=2.0, backup_forwards=4, measured_ratio=0.3),
        (0.1, 0.35),
    )
    assert [r["ratio"] for r in proj["rows"]] == [0.1, 0.3, 0.35]
    assert [r["measured"] for r in proj["rows"]] == [False, True, False]
    assert proj["rows"][0]["sd_speedup"] == pytest.approx(3.0 / 1.4)
    assert proj["rows"][2]["ssd_speedup"] == pytest.approx(2.5 / 2.075)
    assert project(ProjectionInputs(k=4), (0.1,))["rows"][0]["ssd_speedup"] is None


def test_aggregate_math_by_hand():
    spec = {
        "k": 2,
        "rounds": 3,
        "row_rounds": 3,
        "drafted": 6,
        "accepted": 3,
        "emitted": 6,
        "accepted_len_hist": [1, 1, 1],
        "draft_s": 0.006,
        "verify_s": 0.015,
        "ssd_rounds": 3,
        "rows_hit": 2,
        "rows_miss": 1,
        "tokens_on_hit": 5,
        "tokens_on_miss": 1,
        "backup_used": {"jit": 1},
    }  # raw counts of one call (core.stats)
    recs = [
        {
            "system": "ssd",
            "tokens": 7,
            "decode_tokens": 6,
            "decode_s": 1.0,
            "tokens_per_s": 6.0,
            "ttft_s": 0.1,
            "spec": spec,
        },
        {
            "system": "ssd",
            "tokens": 7,
            "decode_tokens": 6,
            "decode_s": 3.0,
            "tokens_per_s": 2.0,
            "ttft_s": 0.3,
            "spec": spec,
        },
        {
            "system": "ar",
            "tokens": 7,
            "decode_tokens": 6,
            "decode_s": 6.0,
            "tokens_per_s": 1.0,
            "ttft_s": 0.2,
            "spec": None,
        },
    ]
    a = aggregate(recs, "ssd")
    assert a["tokens_per_s"] == pytest.approx(12 / 4.0) and a["tokens_per_s_mean"] == pytest.approx(4.0)
    assert a["ttft_s"] == pytest.approx(0.2)
    assert a["acceptance_rate"] == pytest.approx(0.5) and a["mean_accepted_len"] == pytest.approx(2.0)
    assert a["accepted_len_hist"] == [2, 2, 2] and a["cache_hit_rate"] == pytest.approx(2 / 3)
    assert a["tokens_per_round_hit"] == pytest.approx(2.5) and a["tokens_per_round_miss"] == pytest.approx(1.0)
    assert a["draft_ms_per_round"] == pytest.approx(2.0) and a["verify_ms_per_round"] == pytest.approx(5.0)
    aggs = aggregate_all(recs, ["ar", "ssd"], {"ssd": {"status": "exact"}})
    assert aggs["ssd"]["speedup_vs_ar"] == pytest.approx(3.0) and aggs["ssd"]["speedup_vs_sd"] is None


def test_logit_margin_near_tie_in_bf16_ulps():
    class FakeRunner:
        def __init__(self, top2: float) -> None:
            self.top2 = top2

        def reset(self, batch, slots):
            pass

        def feed(self, rows, logits="all"):
            logits = torch.zeros(len(rows[0]), 8)
            logits[-1, 3], logits[-1, 5] = 17.5, self.top2
            return [logits]

    # bf16 at |17.5|: one unit in the last place is 2^(4-7) = 0.125
    tie = logit_margin(FakeRunner(17.375), [1], [2], [3, 5], torch.bfloat16)
    assert tie["margin"] == pytest.approx(0.125) and tie["near_tie"] and tie["top1_id"] == 3
    assert not logit_margin(FakeRunner(16.5), [1], [], (), torch.bfloat16)["near_tie"]
    assert not logit_margin(FakeRunner(17.375), [1], [], (), torch.float32)["near_tie"]


def test_projection_uses_full_depth_hits_only_where_prespeculation_fits():
    from ssdlocal.speculation.projection import ProjectionInputs, project, ssd_speedup

    inputs = ProjectionInputs(k=4, e_sd=3.3, p_hit=0.75, e_hit=2.4, e_miss=3.0, backup_forwards=4)
    rows = {row["ratio"]: row["ssd_speedup"] for row in project(inputs, (0.1, 0.35))["rows"]}
    # T_p = 5 * 0.1 = 0.5 <= 1: the tree completes, a hit carries E_SD tokens
    assert abs(rows[0.1] - ssd_speedup(0.75, 3.3, 3.0, 4, 0.1, 4)) < 1e-12
    # T_p = 5 * 0.35 = 1.75 > 1: measured (cut-short) E_hit
    assert abs(rows[0.35] - ssd_speedup(0.75, 2.4, 3.0, 4, 0.35, 4)) < 1e-12


# ----------------------------------------------------------------------------- sessions
def test_measuring_units_run_a_session_back_to_back():
    a = [BenchPrompt(f"a{t}", "session", "q", "a", t) for t in (2, 1, 3)]
    single = BenchPrompt("x", "chat", "hi")
    units = bench_run.measuring_units([[a[1]], [single], [a[0]], [a[2]]])
    assert [[b for b, _ in unit] for unit in units] == [[0, 2, 3], [1]]  # turns in order, then the single


def test_session_workload_times_each_turn_with_its_own_prefix_reuse(tiny_dir, tmp_path):
    """Each system runs a session's turns back to back from a cold cache: turn 1 reuses
    nothing, later turns reuse their history; the report has the per-turn table."""
    system = "You review code.\n" + "def f(x):\n    return x + 1\n" * 12
    prompts = [
        BenchPrompt(f"s-{t}", "session", q, "s", t, system if t == 1 else None)
        for t, q in enumerate(["What does f do?", "And twice?", "Why?"], 1)
    ]
    settings = bench_run.BenchSettings(modes=("ar", "sd"), chat=True)
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(str(tiny_dir["draft_llama"]), dtype="float32"))),
        pin_cpus=False,
    )
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    run = bench_run.run_bench(config, prompts, settings, params)
    for system in ("ar", "sd"):
        recs = sorted((r for r in run.records if r["system"] == system), key=lambda r: r["turn"])
        assert [r["turn"] for r in recs] == [1, 2, 3]
        assert recs[0]["cached_tokens"] == 0 and recs[0]["prefill_tokens_per_s"] > 0
        assert all(r["cached_tokens"] >= 0.5 * p["prompt_tokens"] for r, p in zip(recs[1:], recs))
    assert run.exactness["sd"]["status"] == "exact"
    doc = build_results(
        run,
        with_projection=False,
        env={
            "hardware": {"cpu": "x", "usable_cores": 1, "ram_gib": 1, "gpus": []},
            "versions": {"ssdlocal": "0", "torch": "0", "transformers": "0", "python": "3"},
        },
    )
    assert [(r["system"], r["turn"]) for r in doc["sessions"]] == [
        ("ar", 1),
        ("ar", 2),
        ("ar", 3),
        ("sd", 1),
        ("sd", 2),
        ("sd", 3),
    ]
    text = write_all(doc, tmp_path)["md"].read_text()
    assert "## Sessions" in text and "| ar | 2 |" in text
    assert load_prompts("session")[0].system.startswith("You are a careful code reviewer")
