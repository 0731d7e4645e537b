"""Running the CLI in-process for tests: exit code, stdout and stderr of `ssdlocal ARGS`.

`main()` is called directly (it maps errors to exit codes; Typer's CliRunner would
bypass that), with sys.argv patched.
"""

from __future__ import annotations

import sys

import pytest


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `ssdlocal ARGS` through main(); return (exit code, stdout, stderr)."""
    from ssdlocal.cli.app import main

    monkeypatch.setattr(sys, "argv", ["ssdlocal", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


# lines a run prints on stderr before an error can happen: preparation steps
# (cli/progress.py, plain lines in tests), the mode line (cli/render.print_mode) and the
# backend choice's note (cli/resolve.py: why `auto` took torch, or how llama.cpp runs on
# this CPU, e.g. with its weight repacking off)
RUN_LINES = (
    "loading ",
    "starting the engine",
    "calibrating ",
    "quantizing ",
    "reading tokenizer: ",
    "checking ",
    "download ",
    "assemble ",
    "converting ",
    "writing ",
    "mode ",
    "backend torch: ",
    "llama-cpp-python ",
)


def assert_clean_error(code: int, err: str, expected_code: int, *needles: str, skip: tuple[str, ...] = ()) -> None:
    """Exactly one `error:` line and one `hint:` line (lines starting with a `skip`
    prefix aside, and what a run prints before it fails: its finished preparation steps
    and its mode line), no traceback, the right exit code, and every needle in the text."""
    assert code == expected_code, err
    assert "Traceback" not in err
    skip = (*skip, *RUN_LINES)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(skip)]
    assert len(lines) == 2, err
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def check_head_draft_cli(monkeypatch, capsys, *base: str) -> str:
    """With options `base` (a target and a draft head): `generate` drafts with the head (auto
    picks SD, the head drafting between verifications) and `check` finds SD reproducing AR.
    Returns check's output."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", "The quick brown fox", *base, "--max-new-tokens", "8")
    assert code == 0, err
    assert "draft head" in err
    code, out, err = run_cli(monkeypatch, capsys, "check", *base, "--max-new-tokens", "12")
    assert code == 0, err
    assert "SD reproduces AR" in out
    return out
