"""engine/fim.py: FIM tokens found in a tokenizer's vocabulary (never from a model's name),
the prompt laid out in those tokens (plain and repository level, as llama.cpp's server
does), user text that spells a FIM token staying text; and suffix drafting proposing from
the text after the cursor.
"""

from __future__ import annotations

import pytest
from support.tiny_models import FIM_SPECIALS, build_tokenizer

from ssdlocal.draft.suffix import SuffixSource
from ssdlocal.engine.fim import ContextFile, fim_prompt, fim_tokens


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """style -> a tiny tokenizer with that family's FIM tokens; None -> the default one."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("fim_tokenizers")
    out = {}
    for style in (*FIM_SPECIALS, None):
        build_tokenizer(root / str(style), tuple(FIM_SPECIALS[style]) if style else ())
        out[style] = AutoTokenizer.from_pretrained(root / str(style))
    return out


def _plain(tok, text):
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("style", list(FIM_SPECIALS))
def test_each_family_is_found_by_its_tokens(tokenizers, style):
    tok = tokenizers[style]
    found = fim_tokens(tok)
    assert found is not None and found.style == style
    names = tok.convert_ids_to_tokens([found.prefix, found.suffix, found.middle])
    assert [n.lstrip("▁") for n in names] == {
        "qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
        "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
        "codellama": ["<PRE>", "<SUF>", "<MID>"],
    }[style]
    assert (found.repo is not None, found.file_sep is not None) == (
        (True, True) if style != "codellama" else (False, False)
    )


def test_a_tokenizer_without_fim_tokens_has_none(tokenizers):
    assert fim_tokens(tokenizers[None]) is None


def test_the_prompt_is_prefix_suffix_middle_in_the_models_tokens(tokenizers):
    tok = tokenizers["qwen"]
    t = fim_tokens(tok)
    before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = fim_prompt(tok, t, before, after)
    assert ids == [t.prefix, *_plain(tok, before), t.suffix, *_plain(tok, after), t.middle]
    assert tok.decode(ids) == f"<|fim_prefix|>{before}<|fim_suffix|>{after}<|fim_middle|>"


def test_text_that_spells_a_fim_token_stays_text(tokenizers):
    tok = tokenizers["qwen"]
    t = fim_tokens(tok)
    ids = fim_prompt(tok, t, "x = '<|fim_suffix|><|fim_middle|>'", "<|endoftext|>")
    assert ids.count(t.suffix) == 1 and ids.count(t.middle) == 1 and 0 not in ids  # 0: <|endoftext|>
    assert ids.index(t.suffix) > ids.index(t.prefix) and ids[-1] == t.middle


def test_repository_level_prompt_names_repo_and_files_like_llama_cpp(tokenizers):
    tok = tokenizers["qwen"]
    t = fim_tokens(tok)
    extra = [ContextFile("util.py", "def helper():\n    return 1\n")]
    ids = fim_prompt(tok, t, "a = ", "\n", prompt="hel", extra=extra)
    expected = (
        "<|repo_name|>myproject\n<|file_sep|>util.py\ndef helper():\n    return 1\n"
        "<|file_sep|>filename\n<|fim_prefix|>a = hel<|fim_suffix|>\n<|fim_middle|>"
    )
    assert tok.decode(ids) == expected
    bare = fim_prompt(tok, t, "a = ", "\n", repo_level=True)  # /infill names them even with no files
    assert tok.decode(bare).startswith("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>")


def test_without_file_tokens_context_files_are_separated_as_text(tokenizers):
    tok = tokenizers["codellama"]
    t = fim_tokens(tok)
    ids = fim_prompt(tok, t, "a = ", "\n", extra=[ContextFile("u.py", "b = 2\n")])
    assert tok.decode(ids) == "\n\n--- snippet ---\n\nb = 2\n▁<PRE>a = ▁<SUF>\n▁<MID>"


class _Row:
    def __init__(self, tokens):
        self.tokens = list(tokens)


def test_suffix_drafting_proposes_from_the_text_after_the_cursor(tokenizers):
    """The drafter's own index holds the whole FIM prompt, so a middle that reaches text
    the suffix already has is continued from it."""
    tok = tokenizers["qwen"]
    t = fim_tokens(tok)
    after = "\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    prompt = fim_prompt(tok, t, "def fibonacci(n):\n    if n < 2:\n", after)
    middle = _plain(tok, "        return n\n    return")
    source = SuffixSource(memory=None)
    source.start([_Row(prompt + middle)])
    proposal = source.proposals([True], 4)[0]
    continuation = _plain(tok, after)
    start = len(_plain(tok, "\n    return"))
    assert proposal.tokens and list(proposal.tokens) == continuation[start : start + len(proposal.tokens)]


def test_generate_fim_suffix_needs_a_fim_model_and_no_chat(tiny_dir, monkeypatch, capsys):
    from support.cli import assert_clean_error, run_cli

    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "def f():",
        "--fim-suffix",
        "\n",
        "--target",
        tiny_dir["llama"],
        "--dtype",
        "float32",
        "--mode",
        "ar",
        "--max-new-tokens",
        "2",
    )
    assert_clean_error(code, err, 2, "no fill-in-the-middle tokens", "--fim-suffix")
    code, out, err = run_cli(
        monkeypatch, capsys, "generate", "def f():", "--fim-suffix", "\n", "--chat", "--target", tiny_dir["llama"]
    )
    assert_clean_error(code, err, 2, "--fim-suffix cannot be combined with --chat")
