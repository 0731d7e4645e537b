"""`--help` reads well at 80 columns and in a pipe: plain text, no line over 80 columns, no
cut option names, no raw type placeholders (`<str>`, `<list[str]>`, `{prompts}`)."""

from __future__ import annotations

import re

import pytest
from support.cli import run_cli

COMMANDS = ["generate", "bench", "chat", "race", "serve", "pairs", "pull", "devices", "check", "export"]


def _help(monkeypatch, capsys, *args) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--help")
    assert code == 0, err
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_and_fits_80_columns(monkeypatch, capsys, command):
    text = _help(monkeypatch, capsys, command)
    assert "\x1b" not in text and "╭" not in text and "│" not in text  # no boxes, no colours
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    assert "…" not in text  # no option name cut short
    assert not re.search(r"<(str|int|float|bool|list\[[a-z]+\])>|\{[a-z_]+\}", text), text


def test_generate_help_names_values_and_keeps_descriptions_wide(monkeypatch, capsys):
    text = _help(monkeypatch, capsys, "generate")
    lines = text.splitlines()
    assert lines[0].endswith("generate [OPTIONS] PROMPTS...")
    for option in (
        "--target PATH",
        "--draft-quantization SCHEME",
        "--max-new-tokens N",
        "--k K",
        "--num-samples INTEGER",
        "--cuda-graphs / --no-cuda-graphs",
    ):
        assert any(line.strip().startswith(option) for line in lines), option
    # descriptions start within 34 columns and run to the margin: not a ~19-column strip
    described = [line for line in lines if line.startswith("  --target PATH")][0]
    assert described.index("Target") <= 34 and len(described) >= 70, described


def test_root_help_lists_the_commands_without_placeholders(monkeypatch, capsys):
    text = _help(monkeypatch, capsys)
    assert "<bool>" not in text and "  --version  " in text  # a flag: no value placeholder
    assert "  generate  " in text and "  cache  " in text
