"""Configuration: `<config dir>/config.toml` tables and SSDLOCAL_<OPTION> variables become
option defaults (flag > environment > file > built-in); bad files are clean errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.cli.settings import load_config
from ssdlocal.core.errors import UsageError
from ssdlocal.core.paths import config_dir


@pytest.fixture
def cfg(tmp_path, monkeypatch) -> Path:
    """An empty config dir (XDG_CONFIG_HOME); returns the config.toml path."""
    monkeypatch.delenv("SSDLOCAL_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in (
        "SSDLOCAL_MAX_NEW_TOKENS",
        "SSDLOCAL_JSON",
        "SSDLOCAL_K",
        "SSDLOCAL_MODE",
        "SSDLOCAL_STOP",
    ):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "xdg" / "ssdlocal" / "config.toml"
    path.parent.mkdir(parents=True)
    return path


def test_config_dir_locations(monkeypatch, tmp_path):
    monkeypatch.delenv("SSDLOCAL_CONFIG_DIR", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config_dir() == tmp_path / ".config" / "ssdlocal"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "x"))
    assert config_dir() == tmp_path / "x" / "ssdlocal"
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path / "mine"))
    assert config_dir() == tmp_path / "mine"


def test_load_config(cfg):
    assert load_config() == {}
    cfg.write_text("[generate]\nmax_new_tokens = 7\n")
    assert load_config() == {"generate": {"max_new_tokens": 7}}


def gen_json(tiny, *extra):
    return [
        "generate",
        "Hello world",
        "--target",
        tiny["llama"],
        "--dtype",
        "float32",
        "--mode",
        "ar",
        *extra,
    ]


def test_precedence_flag_env_file(monkeypatch, capsys, cfg, tiny_dir):
    cfg.write_text("[generate]\nmax-new-tokens = 3\njson = true\n")
    code, out, err = run_cli(monkeypatch, capsys, *gen_json(tiny_dir))
    assert code == 0, err
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 3  # file: 3 tokens, --json
    monkeypatch.setenv("SSDLOCAL_MAX_NEW_TOKENS", "5")
    code, out, err = run_cli(monkeypatch, capsys, *gen_json(tiny_dir))
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 5  # env beats the file
    code, out, err = run_cli(monkeypatch, capsys, *gen_json(tiny_dir, "--max-new-tokens", "2"))
    assert len(json.loads(out)["outputs"][0]["token_ids"]) == 2  # the flag beats both


def test_env_only(monkeypatch, capsys, cfg, tiny_dir):
    monkeypatch.setenv("SSDLOCAL_JSON", "1")
    monkeypatch.setenv("SSDLOCAL_MAX_NEW_TOKENS", "4")
    monkeypatch.setenv("SSDLOCAL_MODE", "sd")
    monkeypatch.setenv("SSDLOCAL_DRAFT", "ngram")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "Hello world",
        "--target",
        tiny_dir["llama"],
        "--dtype",
        "float32",
    )
    assert code == 0, err
    payload = json.loads(out)
    assert payload["mode"] == "sd" and len(payload["outputs"][0]["token_ids"]) == 4


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ("[generate\nk = 4\n", ["is not valid TOML", "hint: fix "]),
        ("[generate]\nturbo = true\n", ["unknown option 'turbo'", "max-new-tokens"]),
        ("[frobnicate]\nk = 4\n", ["unknown command(s): frobnicate", "generate"]),
        ("k = 4\n", ["must be a table like [generate]"]),
        ("[generate]\nk = 0\n", ["k must be >= 1"]),
        ('[generate]\nk = "four"\n', ["[generate]: invalid value 'four' for --k", "fix `k` in"]),
    ],
)
def test_invalid_config_file(monkeypatch, capsys, cfg, content, needles):
    cfg.write_text(content)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--target", "/nowhere", "--mode", "ar")
    assert_clean_error(code, err, 2, *needles)
    if "k must be" not in needles[0]:
        assert str(cfg) in err.split("hint:")[0] or str(cfg) in err


def test_unreadable_config_file(monkeypatch, capsys, cfg):
    cfg.mkdir()  # a directory where the file should be: cannot be read (even as root)
    code, _, err = run_cli(monkeypatch, capsys, "pairs")
    assert_clean_error(code, err, 2, "cannot read config file", str(cfg), "SSDLOCAL_CONFIG_DIR")
    with pytest.raises(UsageError):
        load_config()


def test_bad_env_value_is_a_usage_error(monkeypatch, capsys, cfg):
    monkeypatch.setenv("SSDLOCAL_K", "four")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--mode", "ar")
    assert_clean_error(code, err, 2, "environment variable SSDLOCAL_K", "'four'", "--k", "fix or unset SSDLOCAL_K")


def test_other_commands_read_their_table(monkeypatch, capsys, cfg):
    cfg.write_text("[devices]\ntarget-gb = 5000\n")
    code, _, err = run_cli(monkeypatch, capsys, "devices")
    assert_clean_error(code, err, 1, "the target needs ~")
