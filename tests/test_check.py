"""Pair compatibility on real tokenizer files (type, vocabulary size, padded embedding
rows, token texts, special tokens, chat template) and `ssdlocal check`: greedy AR / SD /
SSD identical in fp32, divergences reported with the target's logit margin, exit codes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

from ssdlocal.bench.check import Divergence, ModeRun, run_check
from ssdlocal.core.config import ModelDraft
from ssdlocal.core.errors import IncompatiblePairError
from ssdlocal.weights.compat import check_pair, check_paths


def _tok_only(src: Path, dst: Path, vocab_size: int | None = None) -> Path:
    """A 'checkpoint' with only tokenizer files and a config.json (no weights needed)."""
    shutil.copytree(
        src,
        dst,
        ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"),
    )
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    config.update({"model_type": "llama"})
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """Tokenizer variants of the tiny suite's tokenizer (384 tokens)."""
    from support import tiny_models as tm
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tok_variants")
    base = tiny_dir["llama"]
    out = {
        "same": _tok_only(base, root / "same"),
        "padded": _tok_only(base, root / "padded", vocab_size=512),  # extra embedding rows: fine
        "short_rows": _tok_only(base, root / "short_rows", vocab_size=300),
    }  # too few rows
    saved = tm.TOKENIZER_VOCAB
    try:
        tm.TOKENIZER_VOCAB = 320
        tm.build_tokenizer(root / "small_tok")
    finally:
        tm.TOKENIZER_VOCAB = saved
    out["other_size"] = _tok_only(root / "small_tok", root / "other_size")
    out["swapped"] = _tok_only(base, root / "swapped")
    data = json.loads((out["swapped"] / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 200][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out["swapped"] / "tokenizer.json").write_text(json.dumps(data))
    out["other_eos"] = _tok_only(base, root / "other_eos")
    cfg = json.loads((out["other_eos"] / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_end|>"
    (out["other_eos"] / "tokenizer_config.json").write_text(json.dumps(cfg))
    out["other_template"] = _tok_only(base, root / "other_template")
    (out["other_template"] / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    # same vocabulary, another tokenizer model (WordLevel instead of BPE)
    base_vocab = json.loads((base / "tokenizer.json").read_text())["model"]["vocab"]
    word = Tokenizer(models.WordLevel(vocab=base_vocab, unk_token="<|endoftext|>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word, eos_token="<|endoftext|>").save_pretrained(root / "wl_tok")
    out["other_type"] = _tok_only(root / "wl_tok", root / "other_type")
    return out


# ----------------------------------------------------------------------------- compat
def test_compatible_pairs_pass(tiny_dir, variants):
    report = check_paths(tiny_dir["llama"], tiny_dir["draft_llama"])
    assert report.warnings == () and "token texts" in report.checks
    assert check_paths(tiny_dir["llama"], variants["padded"]).warnings == ()  # 384 vs 512 rows


@pytest.mark.parametrize(
    ("variant", "needles"),
    [
        ("other_type", ["tokenizer type check failed", "BPE", "WordLevel"]),
        ("other_size", ["vocabulary size check failed", "384 tokens", "draft has 320"]),
        ("short_rows", ["vocabulary size check failed", "300 embedding rows", "ids up to 383"]),
        ("swapped", ["token text check failed", "different ids", "2 ids differ", "id 200"]),
        ("other_eos", ["special token check failed", "eos", "<|im_end|>"]),
    ],
)
def test_incompatible_pairs_name_the_failed_check(tiny_dir, variants, variant, needles):
    with pytest.raises(IncompatiblePairError) as info:
        check_paths(tiny_dir["llama"], variants[variant])
    for needle in needles:
        assert needle in info.value.message, (needle, info.value.message)
    hint = info.value.hint
    assert "same model family" in hint and "known-good pairs:" in hint and "llama-3.1-8b" in hint


def test_chat_template_difference_is_a_warning(tiny_dir, variants):
    report = check_paths(tiny_dir["llama"], variants["other_template"])
    assert any("chat templates differ" in w for w in report.warnings)


def test_check_pair_on_loaded_tokenizers_tolerates_padded_rows(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir["llama"])
    check_pair(tok, tok, target_vocab=512, draft_vocab=384)  # padded rows: fine
    with pytest.raises(IncompatiblePairError, match="the target model has 100 embedding rows"):
        check_pair(tok, tok, target_vocab=100)


# ----------------------------------------------------------------------------- check
def test_check_command_fp32_identical(monkeypatch, capsys, tiny_dir):
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "check",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--max-new-tokens",
        "10",
        "--k",
        "3",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["identical"] is True and report["dtype"] == "float32"
    assert [r["mode"] for r in report["runs"]] == ["ar", "sd", "ssd"]
    ar = report["runs"][0]["token_ids"]
    assert all(r["token_ids"] == ar and r["tokens"] == 30 for r in report["runs"])
    assert all(r["decode_s"] > 0 for r in report["runs"])
    assert report["runs"][1]["acceptance_rate"] is not None


class FakeEngine:
    """Scripted engine: SD diverges at token 2 of prompt 1; the target's margin is tiny."""

    def __init__(self, config):
        self.runner = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def encode(self, prompt, chat):
        return [1, 2, 3]

    def forget_prefixes(self):
        pass

    def generate(self, prompts, params, chat=False, spec=None):
        from ssdlocal.core.events import DoneEvent, Output
        from ssdlocal.core.metrics import Metrics

        ids = [5, 6, 7, 8]
        if spec.mode.value == "sd" and prompts[0] == "p1":
            ids = [5, 6, 9, 8]
        yield DoneEvent(
            (Output("x", tuple(ids), "length"),),
            Metrics(
                tokens=4,
                decode_tokens=3,
                tokens_per_s=30.0,
                decode_s=0.1,
                rounds=2,
                acceptance_rate=0.5 if spec.mode.value != "ar" else None,
            ),
        )

    # runner API used by the logit margin
    def reset(self, batch, slots):
        self.fed_slots = slots

    def feed(self, rows, logits="all"):
        import torch

        assert rows == [[1, 2, 3, 5, 6]]  # prompt + the common prefix
        logits = torch.zeros(len(rows[0]), 10)
        logits[-1, 7], logits[-1, 9] = 4.0, 3.99
        return [logits]


def test_divergence_reports_index_and_margin(tiny_dir):
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig

    config = EngineConfig(
        ModelSpec("t", dtype="bfloat16"),
        SpecConfig(mode=Mode.SSD, draft=ModelDraft(ModelSpec("d", dtype="bfloat16"))),
    )
    report = run_check(config, prompts=("p0", "p1"), engine_factory=FakeEngine)
    assert not report.identical and not report.shape_rounding  # a torch target
    for alike, shapes in ((False, True), (True, False)):
        gguf = dataclasses.replace(config, target=ModelSpec("t.gguf", backend="llamacpp", batch_invariant=alike))
        assert run_check(gguf, prompts=("p0", "p1"), engine_factory=FakeEngine).shape_rounding is shapes
    (div,) = report.divergences
    assert (div.mode, div.prompt_index, div.position, div.ar_token, div.mode_token) == (
        "sd",
        1,
        2,
        7,
        9,
    )
    assert div.margin == pytest.approx(0.01, abs=1e-4) and div.near_tie
    assert report.run("ssd").tokens_per_s == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("dtype", "margin", "verdict", "shapes"),
    [
        ("bfloat16", 0.01, "numerical near-tie in bfloat16", False),
        ("bfloat16", 3.0, "likely a bug", False),
        ("float32", 0.01, "fp32 must be identical", False),
        ("float32", 0.3, "--batch-invariant makes its steps identical", True),  # llama.cpp, default
        ("float32", 3.0, "fp32 must be identical", True),  # larger than its call widths move a logit
    ],
)
def test_check_command_reports_a_divergence(monkeypatch, capsys, tiny_dir, dtype, margin, verdict, shapes):
    from ssdlocal.bench import check as check_mod
    from ssdlocal.bench.check import CheckReport

    def fake_run_check(config, params=None, chat=False, on_mode=None, modes=None):
        assert config.target.dtype == dtype
        runs = tuple(ModeRun(m, ((1, 2),), 2, 1.0, 0.5, 0.6) for m in ("ar", "sd", "ssd"))
        return CheckReport(dtype, ("p",), runs, (Divergence("ssd", 0, 17, 11, 12, margin),), shape_rounding=shapes)

    monkeypatch.setattr(check_mod, "run_check", fake_run_check)
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "check",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        dtype,
    )
    assert code == 1, (out, err)
    assert "ssd: prompt 0 diverges from AR at token 17" in out, err
    assert f"{margin:.4f}" in out
    assert verdict in out and "NOT identical" in out


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["--target", "x"], 2, ["check compares SD and SSD with AR: it needs a draft", "--draft ngram"]),
        (["--pair", "nope"], 2, ["unknown pair 'nope'"]),
        (["--target", "/nowhere/t", "--draft", "/nowhere/d"], 1, ["does not exist"]),
        (["--max-new-tokens", "0"], 2, ["max-new-tokens must be >= 1"]),
        (["--dtype", "int4"], 2, ["unknown --dtype 'int4'"]),
    ],
)
def test_check_bad_input(monkeypatch, capsys, tmp_path, args, code, needles):
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr("ssdlocal.cli.resolve.default_pair_paths", lambda *a, **k: pytest.fail("no download"))
    assert_clean_error(*run_cli(monkeypatch, capsys, "check", *args)[::2], code, *needles)


@pytest.mark.parametrize("extra", [[], ["--draft", "ngram"]])
def test_check_takes_pair_and_draft_like_every_command(monkeypatch, capsys, tiny_dir, extra):
    """--pair names the target and the draft, and --draft replaces the pair's draft, as in
    generate, chat, race, bench and serve (check once refused --pair with --draft)."""
    from ssdlocal.bench import check as check_mod
    from ssdlocal.bench.check import CheckReport
    from ssdlocal.core.config import NgramDraft

    pair = (str(tiny_dir["llama"]), str(tiny_dir["draft_llama"]))
    monkeypatch.setattr("ssdlocal.weights.hub.resolve_pair_paths", lambda name, **kw: pair)
    seen = []

    def fake_run_check(config, params=None, chat=False, on_mode=None, modes=None):
        seen.append(config)
        runs = tuple(ModeRun(m, ((1, 2),), 2, 1.0, 0.5, 0.6) for m in ("ar", "sd", "ssd"))
        return CheckReport("float32", ("p",), runs, ())

    monkeypatch.setattr(check_mod, "run_check", fake_run_check)
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "check",
        "--pair",
        "qwen2.5-1.5b",
        "--target-backend",
        "torch",
        "--target-device",
        "cpu",
        "--draft-device",
        "cpu",
        *extra,
    )
    assert code == 0, err
    (config,) = seen
    assert config.target.path == pair[0] and config.target.dtype == "float32"
    if extra:
        assert config.spec.draft == NgramDraft()
    else:
        assert config.spec.draft.model.path == pair[1]


def test_check_incompatible_pair(monkeypatch, capsys, tiny_dir, variants):
    code, _, err = run_cli(monkeypatch, capsys, "check", "--target", tiny_dir["llama"], "--draft", variants["swapped"])
    assert_clean_error(code, err, 1, "token text check failed", "known-good pairs:")


def test_check_pair_not_pulled(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))
    code, _, err = run_cli(monkeypatch, capsys, "check", "--pair", "qwen2.5-1.5b")
    assert_clean_error(code, err, 1, "pair 'qwen2.5-1.5b' is not downloaded", "ssdlocal pull qwen2.5-1.5b")
