"""`race --no-tui` in a pipe: the table's headers whole and every line within 80 columns,
each step (loading, warm-up, each mode's run) shown on stderr, the answer on stdout."""

from __future__ import annotations

import pytest
from support.cli import run_cli

from ssdlocal.tui.race import COLUMNS, RaceRow, summary_table

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def test_the_summary_table_fits_80_columns_with_whole_headers():
    import io

    from rich.console import Console

    rows = [
        RaceRow("AR", 128, 61.2, 4.6, 2.1, 1.0, None, 1.0, None, None),
        RaceRow(
            "SSD", 128, 14.1, 0.216, 13.1, 10.08, 0.18, 1.67, 0.22, False, 41, "other processes used 1.4 of 2 cores"
        ),
    ]
    buffer = io.StringIO()
    Console(file=buffer, width=80, force_terminal=False).print(summary_table(rows))
    lines = buffer.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in buffer.getvalue()
    assert lines[0].split() == " ".join(name for name, _ in COLUMNS).split()
    assert lines[-1].split() == ["SSD*", "128", "13.1", "10.08×", "216", "ms", "14.1", "s", "18%", "1.67", "22%", "✗"]


def test_race_no_tui_in_a_pipe(tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "race",
        "the cat sat",
        "--no-tui",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--k",
        "3",
        "--raw",
    )
    assert code == 0, err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    header = [line for line in out.splitlines() if line.startswith("mode ")]
    assert header and header[0].split() == " ".join(name for name, _ in COLUMNS).split(), out
    assert "identical output in every mode" in out
    # what stands beside the table: other load, auto's choice here, where SSD's draft runs
    assert "timings: " in out and "auto here: " in out
    assert "SSD: its draft shares the target's CPU" in out
    for step in (
        "warming up AR, SD, SSD: 3/3 modes",
        "running AR: 8/8 tokens",
        "running SD: 8/8 tokens",
        "running SSD: 8/8 tokens",
    ):
        assert step in err, (step, err)


def test_race_with_a_draft_head_runs_ar_and_sd_and_says_why_not_ssd(tiny_dir, tmp_path, monkeypatch, capsys):
    """A draft head drafts in SD only: the race runs AR and SD, identical, and says why
    SSD is not raced instead of failing in its lane."""
    from support.tiny_heads import make_eagle3

    head = make_eagle3(tmp_path / "eagle3", tiny_dir["llama"])
    monkeypatch.setenv("COLUMNS", "120")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "race",
        "the cat sat",
        "--no-tui",
        "--target",
        tiny_dir["llama"],
        "--draft",
        head,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--k",
        "3",
        "--raw",
    )
    assert code == 0, err
    table = out.splitlines()
    table = table[next(i for i, line in enumerate(table) if line.startswith("mode ")) :]
    modes = [line.split()[0] for line in table if line.split()[:1] in (["AR"], ["SD"], ["SSD"])]
    assert modes == ["AR", "SD"], out
    assert "identical output in every mode" in out
    flat = " ".join(out.split())  # the head's path is long: the line wraps where it falls
    assert "SSD: not raced: the eagle3 head" in flat and "drafts in SD only" in flat, out
    assert "running SSD" not in err
