"""A forced call list finishes as soon as it can only end or the model would loop: after
the last call the grammar allows (a named function, parallel_tool_calls false), and after a
call that repeats an earlier one (calllist.CallList), instead of decoding to max_tokens.

The masks first, through the RowGuide every round uses (grammar/guide.py): after a whole
call the grammar allows another or end-of-sequence; after a repeat only end-of-sequence; a
different second call leaves the choice open, and rolling the repeat back (a rejected draft)
reopens it. Then answers of a live server on the tiny Hermes-template llama, whose greedy
answer to a one-valued tool repeats its call: AR ends right after the repeat, and SD's
tokens equal AR's.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.chat_templates import HERMES_TEMPLATE, with_template
from support.drafts import draft_of
from support.server import MODEL, LiveServer

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
from ssdlocal.grammar.guide import RowGuide, unpack
from ssdlocal.server.calllist import CallList
from ssdlocal.server.grammars import RequestGrammars
from ssdlocal.server.protocol import parse_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

USER = [{"role": "user", "content": "Pick one."}]
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"x": {"enum": [1, 2]}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
}
ONE_VALUE = {**PICK, "function": {**PICK["function"], "parameters": {**PICK["function"]["parameters"]}}}
ONE_VALUE["function"]["parameters"]["properties"] = {"x": {"enum": [1]}}  # every call of it is the same call
EOS = 0  # the tiny tokenizer's <|endoftext|>


def call(x: int) -> str:
    return "<tool_call>\n" + json.dumps({"name": "pick", "arguments": {"x": x}}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def hermes_dirs(tiny_dir, tmp_path_factory):
    return with_template(tiny_dir, tmp_path_factory, HERMES_TEMPLATE, "hermes")


@pytest.fixture(scope="module")
def grammars(hermes_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hermes_dirs["llama"])
    return RequestGrammars(tokenizer, len(tokenizer), [EOS], isolate=False)


def guide_for(grammars: RequestGrammars, **fields) -> RowGuide:
    req = parse_chat({"model": MODEL, "messages": USER, "tools": [PICK], **fields}, None)
    grammar = grammars.for_request(req)
    return RowGuide(grammar.matcher(), grammars.compiler.vocab_size, [EOS], grammar.matcher)


def allowed(guide: RowGuide, at: int) -> torch.Tensor:
    return unpack(guide.masks[at], guide.vocab_size)  # [V]


def test_after_a_repeated_call_only_end_of_sequence_is_allowed(grammars):
    tok = grammars.compiler.tokenizer
    grammar = grammars.for_request(
        parse_chat({"model": MODEL, "messages": USER, "tools": [PICK], "tool_choice": "required"}, None)
    )
    assert isinstance(grammar, CallList)
    guide = guide_for(grammars, tool_choice="required")
    first = tok.encode(call(1), add_special_tokens=False)
    again = first + tok.encode("\n" + call(1), add_special_tokens=False)
    other = first + tok.encode("\n" + call(2), add_special_tokens=False)
    assert guide.walk(again) == len(again)
    after_first, after_repeat = allowed(guide, len(first)), allowed(guide, len(again))
    assert after_first[EOS] and after_first.sum() > 1  # another call may follow, or the end
    assert after_repeat[EOS] and after_repeat.sum() == 1  # the model would loop: it ends here
    assert guide.walk(other) == len(other)  # the repeat rolled back (a rejected draft), another call walked
    assert allowed(guide, len(other))[EOS] and allowed(guide, len(other)).sum() > 1
    assert guide.walk(again) == len(again) and allowed(guide, len(again)).sum() == 1
    guide.commit(again)  # committed: the next round starts from the end-only mask
    assert unpack(guide.masks[0], guide.vocab_size).sum() == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "pick"}}},
    ],
)
def test_one_call_allowed_ends_with_it(grammars, fields):
    guide = guide_for(grammars, **fields)
    first = grammars.compiler.tokenizer.encode(call(1), add_special_tokens=False)
    assert guide.walk(first) == len(first)
    end = allowed(guide, len(first))
    assert end[EOS] and end.sum() == 1  # no further whole call can follow


def start(dirs, mode: Mode) -> LiveServer:
    spec = SpecConfig(mode=mode, k=3, draft=draft_of(str(dirs["draft_llama"])))
    return LiveServer(EngineConfig(ModelSpec(str(dirs["llama"]), dtype="float32"), spec, pin_cpus=False))


def ask(live: LiveServer, **fields):
    return live.client.chat.completions.create(
        model=MODEL,
        messages=USER,
        temperature=0,
        max_tokens=1500,
        extra_body={"return_token_ids": True},
        **fields,
    )


def test_a_repeating_answer_finishes_after_the_repeat_in_every_mode(hermes_dirs):
    ar = start(hermes_dirs, Mode.AR)
    try:
        res = ask(ar, tools=[ONE_VALUE], tool_choice="required")
        named = ask(ar, tools=[ONE_VALUE], tool_choice={"type": "function", "function": {"name": "pick"}})
    finally:
        ar.close()
    choice = res.choices[0]
    ids = choice.model_extra["token_ids"]
    text = ar.engine.tokenizer.decode(ids[:-1])
    assert text.count("<tool_call>") == 2 and text.endswith("</tool_call>")  # the model repeated its call ...
    assert ids[-1] == EOS and res.usage.completion_tokens == len(ids) < 1500  # ... and was ended right there
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("pick", {"x": 1})
    ]
    named_ids = named.choices[0].model_extra["token_ids"]
    assert ar.engine.tokenizer.decode(named_ids[:-1]).endswith("</tool_call>") and named_ids[-1] == EOS
    sd = start(hermes_dirs, Mode.SD)
    try:
        assert ask(sd, tools=[ONE_VALUE], tool_choice="required").choices[0].model_extra["token_ids"] == ids
    finally:
        sd.close()
