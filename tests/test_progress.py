"""First-run progress: one Rich display, each stage in its own unit (files, bytes,
tensors, steps), a new bar when a finished stage starts again for the next file."""

from __future__ import annotations

import io

from rich.console import Console

from ssdlocal.cli.render import progress_callback


def _draw(updates) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False)
    with progress_callback(console) as progress:
        for update in updates:
            progress(*update)
    return buffer.getvalue()


def test_each_stage_counts_in_its_unit():
    text = _draw([
        ("download", 6, 6),
        ("assemble", 3_000_000, 3_000_000),
        ("dequantize", 290, 290),
        ("convert", 4, 4),
    ])
    assert "6/6 files" in text
    assert "3.0/3.0 MB" in text
    assert "290/290 tensors" in text
    assert "4/4 steps" in text
    assert "bytes" not in text  # no "6/6 bytes", no "0 bytes/s"


def test_a_stage_for_the_next_file_gets_its_own_bar():
    text = _draw([("download", 6, 6), ("download", 0, 3), ("download", 3, 3)])
    assert "6/6 files" in text and "3/3 files" in text
