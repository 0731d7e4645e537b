"""Progress on stderr: one Rich display on a terminal, each stage in its own unit (files,
bytes, tensors, steps) with an estimate, a new bar when a finished stage starts again for
the next file; plain lines (start, about every 10 s, end) when stderr is not a terminal;
library code reports through core.progress to whichever display is installed."""

from __future__ import annotations

import io

from rich.console import Console

from ssdlocal.cli.progress import _PlainDisplay, preparing, progress_display
from ssdlocal.core import progress as core_progress

STAGES = [
    ("download qwen", 6, 6),
    ("assemble qwen (sha256 checked)", 3_000_000, 3_000_000),
    ("converting qwen to bf16", 290, 290),
    ("quantizing qwen to int4", 2_500_000_000, 5_000_000_000),
    ("calibrating the models", 4, 4),
]


def _draw(updates, terminal: bool = True, width: int = 80) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=terminal, color_system=None)
    with progress_display(console) as progress:
        for update in updates:
            progress(*update)
    return buffer.getvalue()


def test_each_stage_counts_in_its_unit_on_a_terminal():
    text = _draw(STAGES)
    assert "6/6 files" in text
    assert "3.0/3.0 MB" in text
    assert "290/290 tensors" in text
    assert "2.5/5.0 GB" in text
    assert "4/4 steps" in text
    assert "bytes" not in text  # no "6/6 bytes", no "0 bytes/s"
    for stage, *_ in STAGES:
        assert stage in text  # the stage names what runs, at 80 columns


def test_plain_lines_when_stderr_is_not_a_terminal():
    text = _draw([*STAGES, ("quantizing qwen to int4", 5e9, 5e9)], terminal=False)
    assert "\x1b" not in text and "━" not in text
    lines = text.splitlines()
    assert "quantizing qwen to int4: 5.0/5.0 GB, done" in lines, lines
    assert "download qwen: 6/6 files, done" in lines, lines
    assert "calibrating the models: 4/4 steps, done" in lines, lines
    assert len(lines) == len(STAGES), lines  # steps that end at once: one line each


def test_plain_lines_give_an_estimate_and_are_not_every_update():
    buffer = io.StringIO()
    now = [0.0]
    plain = _PlainDisplay(Console(file=buffer, width=80), clock=lambda: now[0])
    for step in range(0, 101):  # one update per second, 100 s in all
        now[0] = float(step)
        plain("quantizing m to int4", step * 1e7, 1e9)
    plain.close()
    lines = buffer.getvalue().splitlines()
    assert 8 <= len(lines) <= 13, lines  # once it has run 1 s, about every 10 s, at the end
    assert lines[0] == "quantizing m to int4: 0.0/1.0 GB (1%, about 99 s left)", lines
    assert "(51%, about 49 s left)" in lines[5], lines
    assert lines[-1] == "quantizing m to int4: 1.0/1.0 GB, done in 100 s", lines


def test_plain_lines_stay_silent_for_a_step_cut_short_at_once():
    """An error right away (a missing model path) must be the only output."""
    buffer = io.StringIO()
    with progress_display(Console(file=buffer, width=80, force_terminal=False)) as progress:
        progress("starting the engine", 0, 1)
    assert buffer.getvalue() == ""


def test_a_stage_for_the_next_file_gets_its_own_bar():
    text = _draw([("download", 6, 6), ("download", 0, 3), ("download", 3, 3)])
    assert "6/6 files" in text and "3/3 files" in text


def test_library_code_reports_to_the_installed_display():
    seen = []
    assert core_progress.reporter() is None  # nothing installed: steps report nothing
    with core_progress.showing(lambda *a: seen.append(a)):
        core_progress.report("loading m (int4)", 1, 2)
        assert core_progress.reporter() is not None
    core_progress.report("loading m (int4)", 2, 2)  # uninstalled again
    assert seen == [("loading m (int4)", 1, 2)]


def test_nested_preparing_reuses_the_outer_display():
    buffer = io.StringIO()
    console = Console(file=buffer, width=80, force_terminal=False)
    with preparing(console) as outer, preparing(console) as inner:
        assert inner is outer
        core_progress.report("calibrating", 1, 1)
    assert "calibrating: 1/1 steps" in buffer.getvalue()


def test_model_labels_drop_the_file_quantization():
    assert core_progress.model_label("/x/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") == "qwen2.5-coder-1.5b"
    assert core_progress.model_label("SmolLM2-135M-Instruct-Q4_1.gguf") == "SmolLM2-135M"
    assert core_progress.model_label("/ckpt/Qwen2.5-0.5B") == "Qwen2.5-0.5B"
