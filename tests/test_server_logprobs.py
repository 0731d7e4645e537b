"""Log-probabilities leave out the end-of-turn token: a chat answer that ends with Qwen's
`<|im_end|>` returns logprobs for its text's tokens only, whole and streamed, and those
tokens join to the content (OpenAI never returns the end token); a completion's tokens
join to its text the same way, with matching `text_offset`s.

The model is the 2-layer tiny llama made to end its turn: `<|im_end|>` (an end-of-sequence
id in its generation config, as in Qwen's) outscores the token its greedy answer would
emit a few tokens in (support/tiny_models.make_turn_ender). AR server on 127.0.0.1.
"""

from __future__ import annotations

import pytest
from support.server import MODEL, LiveServer
from support.tiny_models import make_turn_ender

openai = pytest.importorskip("openai")

from ssdlocal.core.config import EngineConfig, ModelSpec
from ssdlocal.engine.prompts import encode_messages

USER = [{"role": "user", "content": "Is the sky blue?"}]
END = "<|im_end|>"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def live(tiny_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    prompt = encode_messages(AutoTokenizer.from_pretrained(tiny_dir["llama"]), USER)
    dest = tmp_path_factory.mktemp("turn") / "llama_turn"
    words = make_turn_ender(tiny_dir["llama"], dest, prompt)
    server = LiveServer(EngineConfig(target=ModelSpec(str(dest), dtype="float32")))
    server.words, server.prompt = words, prompt  # tokens before the end token; the prompt's ids
    server.end = server.engine.tokenizer.convert_tokens_to_ids(END)
    yield server
    server.close()


def test_chat_logprobs_leave_out_the_end_of_turn_token(live):
    ask = dict(model=MODEL, messages=USER, max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    whole = live.client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.finish_reason == "stop" and ids[-1] == live.end and len(ids) == live.words + 1
    entries = choice.logprobs.content
    assert len(entries) == live.words and END not in [e.token for e in entries]
    assert "".join(e.token for e in entries) == choice.message.content != ""
    assert whole.usage.completion_tokens == len(ids)  # the end token is still generated and billed

    chunks = list(live.client.chat.completions.create(**ask, stream=True))
    streamed = [e for chunk in chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert "".join(e.token for e in streamed) == text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_join_to_the_text(live):
    done = live.client.completions.create(model=MODEL, prompt=live.prompt, max_tokens=32, temperature=0, logprobs=2)
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and len(choice.logprobs.tokens) == live.words
    assert "".join(choice.logprobs.tokens) == choice.text
    offsets = [sum(map(len, choice.logprobs.tokens[:i])) for i in range(live.words)]
    assert choice.logprobs.text_offset == offsets
    chunks = list(
        live.client.completions.create(
            model=MODEL, prompt=live.prompt, max_tokens=32, temperature=0, logprobs=2, stream=True
        )
    )
    streamed = [t for chunk in chunks for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == choice.logprobs.tokens and "".join(c.choices[0].text for c in chunks) == choice.text
