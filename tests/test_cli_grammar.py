"""`ssdlocal generate --json-schema FILE` / `--regex`: constrained answers from the command
line, and bad grammars refused with error/hint before any model loads."""

from __future__ import annotations

import json

import pytest
from support.cli import assert_clean_error, run_cli

pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gen(tiny_dir, *extra):
    return (
        "generate",
        "Is the cat fed?",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--json",
        "--max-new-tokens",
        "200",
        *extra,
    )


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_json_schema_and_regex_answers_follow_them(monkeypatch, capsys, tiny_dir, tmp_path, mode):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"fed": {"type": "boolean"}},
        "required": ["fed"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    code, out, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", mode, "--json-schema", path))
    assert code == 0, err
    result = json.loads(out)
    answer = result["outputs"][0]
    assert answer["finish_reason"] == "eos", answer
    jsonschema.validate(json.loads(answer["text"]), schema)
    assert result["stats"]["constrained"] is True
    code, out, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", mode, "--regex", "(yes|no), [0-9]"))
    assert code == 0, err
    text = json.loads(out)["outputs"][0]["text"]
    assert text.startswith(("yes, ", "no, ")) and text[-1].isdigit(), text


def test_bad_grammars_are_usage_errors(monkeypatch, capsys, tiny_dir, tmp_path):
    unsupported = tmp_path / "not.json"
    unsupported.write_text(json.dumps({"type": "object", "not": {"required": ["a"]}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    for extra, needle in (
        (("--json-schema", unsupported), "not"),
        (("--json-schema", broken), "not JSON"),
        (("--json-schema", tmp_path / "missing.json"), "cannot read"),
        (("--regex", "(unclosed"), "regex"),
        (("--regex", "a", "--json-schema", unsupported), "cannot be combined"),
    ):
        code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, *extra))
        assert_clean_error(code, err, 2, needle)
