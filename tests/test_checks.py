"""The static checks developers run are the ones CI runs: the commands of
docs/development.md's "Checks" section are the lines `.ci/run` runs after the README's
test command, in the same order, and the checkers' settings live in pyproject.toml.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _documented_checks() -> list[str]:
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("\n## Checks\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```", section, re.M | re.S)
    assert block, "docs/development.md#checks has no bash block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def _ci_checks() -> list[str]:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = next(i for i, line in enumerate(lines) if "python -m pytest" in line)
    return [line for line in lines[readme + 1 :] if line and not line.startswith("#")]


def test_ci_runs_the_documented_checks_after_the_readme_command():
    assert _documented_checks() == _ci_checks()
    assert _ci_checks(), "no static checks after the README command in .ci/run"


def test_the_checkers_are_configured_and_installed_by_the_dev_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = {re.split(r"[<>=\[ ]", req, 1)[0] for req in project["project"]["optional-dependencies"]["dev"]}
    for command in _documented_checks():
        tool = command.split()[0]
        assert tool in dev, f"{tool} is run by CI but not in the dev extra"
        assert tool in project["tool"], f"{tool} has no [tool.{tool}] section in pyproject.toml"
    checked = set(project["tool"]["mypy"]["files"])
    assert {"ssdlocal/core", "ssdlocal/draft", "ssdlocal/backends/base.py", "ssdlocal/engine"} <= checked
