"""Row: incremental decoding while a row runs gives the same text as one full decode;
streamed deltas add up to the final text; stop strings and partial UTF-8 are held back."""

from __future__ import annotations

import pytest

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sequence import Row


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir["llama"])


def _stream(tokenizer, ids, **params) -> tuple[Row, list[str]]:
    row = Row([1], SamplingParams(max_new_tokens=len(ids), **params), frozenset({0}), tokenizer)
    deltas = []
    for token in ids:
        if not row.append(token):
            break
        deltas.append(row.take_text_delta())
    return row, deltas


def test_streamed_text_equals_the_full_decode(tokenizer):
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) 🙂 é"
    ids = tokenizer.encode(text, add_special_tokens=False)
    row, deltas = _stream(tokenizer, ids)
    assert row.finish_reason == "length"
    assert "".join(deltas) == row.text() == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)  # partial characters are never streamed


def test_running_text_tracks_every_prefix(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好", add_special_tokens=False)
    row = Row([1], SamplingParams(max_new_tokens=1000), frozenset(), tokenizer)
    for i, token in enumerate(ids, start=1):
        row.append(token)
        full = tokenizer.decode(ids[:i], skip_special_tokens=True)
        running = row.text()
        assert full.startswith(running) and (
            running == full or full.endswith("\ufffd") or len(full) - len(running) <= 4
        ), (i, running, full)


def test_stop_string_cuts_the_text_and_is_never_streamed(tokenizer):
    text = "for i in range(10):\n    print(i * i)\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    row, deltas = _stream(tokenizer, ids, stop=("print",))
    assert row.finish_reason == "stop"
    assert "".join(deltas) == row.text() == "for i in range(10):\n    "
    assert "pri" not in "".join(deltas)
