"""scripts/gpu_accept.py without a GPU: every step's section says what its rows measure, a
failing step is listed under failures, and the hybrid step (scripts/accept_hybrid.py) runs
its smoke shapes with traced graphs, captured equal to eager."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _gpu_accept():
    sys.path.insert(0, str(SCRIPTS))
    import gpu_accept

    return gpu_accept


def test_every_step_renders_with_what_it_measures_and_failures_stay_failures():
    ga = _gpu_accept()
    for step in (*ga.SPEED_STEPS, *ga.MORE_STEPS):
        assert step in ga.MEASURES, step
    data = {
        "steps": {
            "family_step_times": {"graphs": "trace", "rows": [{"model": "tiny moe", "T": 1, "argmax_equal": True}]},
            "hybrid_rounds": {"rows": [{"model": "tiny qwen3.5", "waits_per_round": 2.0, "budget": 1.5}]},
            "head_rounds": {"rows": [{"model": "tiny llama + eagle3 head", "sd_equals_ar": False}]},
        },
        "failures": ["head_rounds: tiny llama + eagle3 head: SD with graphs, AR with graphs and eager AR differ"],
    }
    text = ga.render(data)
    for step in ("family_step_times", "hybrid_rounds", "head_rounds"):
        assert f"## {step}\n\n_{ga.MEASURES[step]}_" in text
    assert "| tiny llama + eagle3 head | False |" in text
    assert text.split("## failures")[1].strip().startswith("- head_rounds: tiny llama")


class _Results:
    def __init__(self) -> None:
        self.steps: dict = {}
        self.failures: list[str] = []

    def put(self, step, value) -> None:
        self.steps[step] = value

    def fail(self, what) -> None:
        self.failures.append(what)


def test_hybrid_step_smoke_captures_and_equals_eager():
    _gpu_accept()
    from accept_hybrid import STEP, hybrid_step_times

    results = _Results()
    hybrid_step_times(torch.device("cpu"), 1e9, "trace", results, smoke=True)
    rows = results.steps[STEP]["rows"]
    assert [r["T"] for r in rows] == [1, 5] and not results.failures
    for r in rows:
        assert r["bitwise"] and r["captured"] > 0 and r["replays"] > 0 and not r["refused"] and not r["dropped"]
        assert 0 < r["states_mb"] and 0 < r["kept_mb"] and r["kept_ms"] > 0
    assert rows[1]["kept_mb"] > rows[0]["kept_mb"]  # a verify keeps a state per token
