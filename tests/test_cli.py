"""CLI edge: bad input gives `error:` / `hint:` lines and exit 2 (usage) or 1 (runtime),
never a traceback; `generate --json` prints one object; sampling is seeded; streaming.

Most cases call `ssdlocal.cli.main()` in-process (it maps errors to exit codes; Typer's
CliRunner would bypass that); two run `python -m ssdlocal` as a real subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.cli import assert_clean_error, run_cli

STATS_KEYS = {
    "tokens",
    "tokens_per_s",
    "ttft_s",
    "rounds",
    "acceptance_rate",
    "mean_accepted_len",
    "per_position_acceptance",
    "draft_ms",
    "verify_ms",
}


def gen(tiny: dict[str, Path], *extra: str) -> list[str]:
    """`generate` args on the tiny llama pair, fp32, short, AR unless `extra` says --mode."""
    return [
        "generate",
        "Hello world",
        "--target",
        tiny["llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--mode",
        "ar",
        *extra,
    ]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def odd_checkpoints(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """Checkpoints that must be refused: other vocabularies, an unsupported architecture."""
    from support import tiny_models as tm

    root = tmp_path_factory.mktemp("odd_models")
    small = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}
    saved = tm.TOKENIZER_VOCAB
    try:  # a tokenizer of another size (vocabulary size check) ...
        tm.TOKENIZER_VOCAB = 320
        tm.build_tokenizer(root / "tok_small")
    finally:
        tm.TOKENIZER_VOCAB = saved
    # ... and one of the same size with two token ids swapped (token text check)
    shutil.copytree(
        tiny_dir["llama"],
        root / "tok_other",
        ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"),
    )
    tok_json = root / "tok_other" / "tokenizer.json"
    data = json.loads(tok_json.read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 100][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_json.write_text(json.dumps(data))
    out = {
        "draft_other_size": tm.make_tiny_checkpoint(root / "d1", tokenizer_dir=root / "tok_small", **small),
        "draft_other_text": tm.make_tiny_checkpoint(root / "d2", tokenizer_dir=root / "tok_other", **small),
    }
    from transformers import GPT2Config

    gpt2 = root / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=384, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    out["gpt2"] = gpt2
    out["not_a_checkpoint"] = root / "empty"
    out["not_a_checkpoint"].mkdir()
    (root / "weights.bin").write_bytes(b"\0" * 16)
    out["plain_file"] = root / "weights.bin"
    return out


# ----------------------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--mode", "sd", "--draft", "ngram", "--k", "0"], ["k must be >= 1"]),
        (["--temperature", "-0.5"], ["temperature must be >= 0"]),
        (["--top-p", "0"], ["top-p must be in (0, 1]"]),
        (["--top-p", "1.5"], ["top-p must be in (0, 1]"]),
        (["--max-new-tokens", "0"], ["max-new-tokens must be >= 1"]),
        (["--mode", "turbo"], ["unknown mode 'turbo'", "ar, sd, ssd"]),
        (["--dtype", "int3"], ["unknown --dtype 'int3'", "float32"]),
        (["--target-device", "tpu"], ["unknown device 'tpu'", "cuda"]),
        (["--mode", "ssd", "--draft", "ngram", "--draft-device", "gpu0"], ["unknown device 'gpu0'"]),
        (["--mode", "sd"], ["--mode sd needs --draft", "--draft ngram"]),
        (["--num-samples", "0"], ["num-samples must be >= 1"]),
        (["--mode", "ssd", "--draft", "ngram", "--k", "2", "--fan-out", "1,1"], ["fan-out needs K+1 = 3"]),
        (["--stop", ""], ["stop strings must not be empty"]),
    ],
)
def test_bad_option_values_are_usage_errors(monkeypatch, capsys, tiny_dir, extra, needles):
    assert_clean_error(*run_cli(monkeypatch, capsys, *gen(tiny_dir, *extra))[::2], 2, *needles)


def test_empty_prompt(monkeypatch, capsys, tiny_dir):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "   ", "--target", tiny_dir["llama"])
    assert_clean_error(code, err, 2, "empty prompt")


def test_option_errors_come_before_the_default_pair_download(monkeypatch, capsys):
    from ssdlocal.cli import resolve

    def no_download(*args, **kwargs):
        raise AssertionError("the default pair must not be fetched for a bad option")

    monkeypatch.setattr(resolve, "default_pair_paths", no_download)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--k", "0")
    assert_clean_error(code, err, 2, "k must be >= 1")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "hi", "--bogus"], "No such option: --bogus"),
        (["generate"], "Missing argument"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["generate", "hi", "--k", "four"], "Invalid value for '--k'"),
    ],
)
def test_click_usage_errors_are_clean(monkeypatch, capsys, args, needle):
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert_clean_error(code, err, 2, needle, "--help")


def test_version_and_bare_command(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("ssdlocal ")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
    )
    assert code == 2 and "generate" in out and "Traceback" not in err


# ----------------------------------------------------------------------------- runtime errors
@pytest.mark.parametrize(
    ("which", "needles"),
    [
        ("missing", ["does not exist", "checkpoint directory"]),
        ("not_a_checkpoint", ["has no config.json"]),
        ("plain_file", ["not a .gguf file"]),
        ("gpt2", ["unsupported model", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]),
    ],
)
def test_bad_target_path(monkeypatch, capsys, tmp_path, odd_checkpoints, which, needles):
    path = tmp_path / "nowhere" if which == "missing" else odd_checkpoints[which]
    code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--target", path, "--mode", "ar")
    assert_clean_error(code, err, 1, *needles)


@pytest.mark.parametrize(
    ("which", "needles"),
    [
        ("draft_other_size", ["vocabulary size check failed", "384 tokens", "same model family"]),
        ("draft_other_text", ["token text check failed", "different ids"]),
    ],
)
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_incompatible_draft(monkeypatch, capsys, tiny_dir, odd_checkpoints, which, needles, mode):
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", mode, "--draft", odd_checkpoints[which]))
    assert_clean_error(code, err, 1, *needles)


def test_bad_draft_path(monkeypatch, capsys, tiny_dir, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", "ssd", "--draft", tmp_path / "x"))
    assert_clean_error(code, err, 1, "does not exist", "--draft")


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("target", "needles"),
    [
        ("ssdlocal.backends.torch.loader.read_state_dict", ["not enough memory", "--dtype"]),
        ("ssdlocal.backends.torch.runner.TorchRunner.feed", ["out of memory running the target"]),
        # not mapped by the library: the CLI's last line of defence still prints two lines
        ("ssdlocal.backends.torch.runner.TorchRunner.reset", ["out of memory", "smaller"]),
    ],
)
def test_out_of_memory(monkeypatch, capsys, tiny_dir, target, needles):
    monkeypatch.setattr(target, _oom)
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", "ar"))
    assert_clean_error(code, err, 1, *needles)


def test_unexpected_exception_is_one_line_without_verbose(monkeypatch, capsys, tiny_dir):
    def boom(*args, **kwargs):
        raise ValueError("something odd")

    monkeypatch.setattr("ssdlocal.backends.torch.runner.TorchRunner.reset", boom)
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", "ar"))
    assert_clean_error(code, err, 1, "unexpected ValueError: something odd", "--verbose")


def test_keyboard_interrupt_exits_130(monkeypatch, capsys, tiny_dir):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("ssdlocal.backends.torch.runner.TorchRunner.feed", interrupt)
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", "ar"))
    assert code == 130 and "interrupted" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- output
def _json(monkeypatch, capsys, args) -> dict:
    code, out, err = run_cli(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_json_output_every_mode(monkeypatch, capsys, tiny_dir):
    runs = {
        "ar": ["--mode", "ar"],
        "sd-ngram": ["--mode", "sd", "--draft", "ngram"],
        "sd": ["--mode", "sd", "--draft", tiny_dir["draft_llama"]],
        "ssd": ["--mode", "ssd", "--draft", tiny_dir["draft_llama"], "--k", "3"],
    }
    results = {}
    for name, extra in runs.items():
        payload = _json(monkeypatch, capsys, gen(tiny_dir, "--max-new-tokens", "12", *extra))
        assert payload["mode"] == extra[1]
        assert len(payload["outputs"]) == 1
        out = payload["outputs"][0]
        assert isinstance(out["text"], str) and len(out["token_ids"]) == 12
        assert STATS_KEYS <= set(payload["stats"]), name
        assert payload["stats"]["tokens"] == 12
        results[name] = out["token_ids"]
        if name in ("sd", "ssd"):  # a model draft always drafts (n-gram may find no match)
            assert payload["stats"]["acceptance_rate"] is not None
    # greedy in fp32: every mode is token-for-token AR
    assert all(ids == results["ar"] for ids in results.values()), results
    assert "cache_hit_rate" in payload["stats"]  # the ssd run


def test_num_samples_seeded(monkeypatch, capsys, tiny_dir):
    def sample(seed: int) -> list[list[int]]:
        args = gen(
            tiny_dir,
            "--mode",
            "sd",
            "--draft",
            "ngram",
            "--temperature",
            "1",
            "--num-samples",
            "3",
            "--seed",
            str(seed),
            "--max-new-tokens",
            "8",
        )
        payload = _json(monkeypatch, capsys, args)
        assert len(payload["outputs"]) == 3
        return [o["token_ids"] for o in payload["outputs"]]

    first, again, other = sample(5), sample(5), sample(6)
    assert first == again
    assert first != other
    assert len({tuple(ids) for ids in first}) > 1  # the samples are independent draws


def test_streaming_prints_text_and_stats_line(monkeypatch, capsys, tiny_dir):
    payload = _json(monkeypatch, capsys, gen(tiny_dir, "--mode", "ar", "--max-new-tokens", "10"))
    code, out, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--mode", "ar", "--max-new-tokens", "10"))
    assert code == 0, err
    assert out == payload["outputs"][0]["text"] + "\n"
    stats_lines = [line for line in err.splitlines() if line.startswith("ar: ")]
    assert len(stats_lines) == 1, err
    assert "10 tokens" in stats_lines[0] and "tok/s" in stats_lines[0]


def test_several_prompts_print_each_output(monkeypatch, capsys, tiny_dir):
    args = [
        "generate",
        "Hello world",
        "The cat",
        "--target",
        tiny_dir["llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--mode",
        "ar",
    ]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "=== [0] ===" in out and "=== [1] ===" in out


# ----------------------------------------------------------------------------- real processes
def test_python_dash_m_usage_errors():
    for args, needle in (
        (["generate", "hi", "--nope"], "No such option: --nope"),
        (["generate", "hi", "--target", "/nonexistent/ckpt", "--temperature", "-1"], "temperature"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "ssdlocal", *args], check=False, capture_output=True, text=True, timeout=60
        )
        assert_clean_error(proc.returncode, proc.stderr, 2, needle)


def test_python_dash_m_runtime_error(tiny_dir, odd_checkpoints):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssdlocal",
            *map(str, gen(tiny_dir, "--mode", "ssd", "--draft", odd_checkpoints["draft_other_text"])),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_clean_error(proc.returncode, proc.stderr, 1, "token text check failed")


# ----------------------------------------------------------------- chat / race option wiring
def test_race_no_tui_runs_every_mode_and_reports_identical_output(monkeypatch, capsys, tiny_dir):
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "race",
        "hello world",
        "--no-tui",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
    )
    assert code == 0, err
    for mode in ("AR", "SD", "SSD"):
        assert mode in out


def test_chat_bad_fan_out_is_a_clean_usage_error(monkeypatch, capsys, tiny_dir):
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "chat",
        "--target",
        tiny_dir["llama"],
        "--draft",
        "ngram",
        "--fan-out",
        "1,x",
    )
    assert_clean_error(code, err, 2, "fan-out")
