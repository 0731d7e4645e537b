"""One default answer length for generate, chat and serve: until end-of-sequence,
bounded by the model's context; --max-new-tokens caps it. bench, check and race
measure a fixed count."""

from __future__ import annotations

import inspect
import json

from support.cli import run_cli

from ssdlocal.cli import bench, check, generate, options, serve, tui


def _default(command, name: str = "max_new_tokens"):
    return inspect.signature(command).parameters[name].default


def test_generate_chat_and_serve_share_one_default():
    assert options.DEFAULT_MAX_NEW_TOKENS is None
    for command in (generate.generate, tui.chat, serve.serve):
        assert _default(command) is options.DEFAULT_MAX_NEW_TOKENS, command.__name__
    for command in (bench.bench, check.check, tui.race):  # these measure a fixed count
        assert isinstance(_default(command), int), command.__name__


def test_generate_runs_to_the_end_of_the_context_by_default(monkeypatch, capsys, tiny_dir):
    args = [
        "generate",
        "Hello world",
        "--target",
        tiny_dir["small_llama"],
        "--dtype",
        "float32",
        "--mode",
        "ar",
        "--json",
    ]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    answer = json.loads(out)["outputs"][0]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--max-new-tokens", "9")
    assert code == 0, err
    capped = json.loads(out)["outputs"][0]
    assert capped["finish_reason"] == "length" and len(capped["token_ids"]) == 9
    assert answer["token_ids"][:9] == capped["token_ids"]
    if answer["finish_reason"] == "eos":  # a random tiny model rarely ends on its own
        assert len(answer["token_ids"]) > 9
    else:  # so it fills the context: prompt + answer = 512 positions
        from transformers import AutoTokenizer

        prompt = len(AutoTokenizer.from_pretrained(tiny_dir["small_llama"])("Hello world").input_ids)
        assert answer["finish_reason"] == "length"
        assert prompt + len(answer["token_ids"]) == 512
