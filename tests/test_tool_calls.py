"""Tool calls without a model: the request fields (tools, tool_choice, response_format,
logprobs) and their errors, the formats chosen from chat templates, and the parser that
reads calls out of an answer — the same pieces whether it streams or arrives whole."""

from __future__ import annotations

import json
import random

import pytest

from ssdlocal.core.sequence import FinishReason
from ssdlocal.server.protocol import APIError, parse_chat, parse_completion
from ssdlocal.server.structured import MAX_TOOLS
from ssdlocal.server.tool_parse import CallArgs, CallStart, ToolCallParser, collect
from ssdlocal.server.tools import HERMES, LLAMA3_JSON, detect_format, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": USER, **fields}, None)


def error_param(fn, **fields) -> str:
    with pytest.raises(APIError) as info:
        fn(**fields)
    assert info.value.status == 400
    return info.value.body()["error"]["param"]


def test_tools_and_tool_choice_parse():
    req = chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert [t.name for t in req.tools] == ["get_weather", "add"]
    assert req.tool_choice.mode == "function" and req.tool_choice.name == "add" and req.constrained
    assert chat(tools=[WEATHER]).tool_choice.mode == "auto" and not chat(tools=[WEATHER]).constrained
    assert chat(tools=[WEATHER], tool_choice="required").tool_choice.forced
    assert chat().tool_choice.mode == "none"
    assert req.tools[0].as_template() == WEATHER
    assert chat(tools=[WEATHER], tool_choice="required").tool_choice.parallel
    assert not chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tool_choice.parallel
    assert error_param(chat, tools=[WEATHER], parallel_tool_calls="no") == "parallel_tool_calls"


def test_bad_tool_fields_name_their_param():
    assert error_param(chat, tools=[WEATHER] * 2) == "tools"  # duplicate names
    assert (
        error_param(
            chat,
            tools=[{**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}} for i in range(MAX_TOOLS + 1)],
        )
        == "tools"
    )
    not_schema = {"type": "function", "function": {"name": "f", "parameters": ["x"]}}
    assert error_param(chat, tools=[not_schema]) == "tools[0].function.parameters"
    bad_type = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strng"}}}},
    }
    assert error_param(chat, tools=[bad_type]) == "tools[0].function.parameters"
    assert error_param(chat, tools=[{"type": "function", "function": {"name": "bad name"}}]) == "tools[0].function.name"
    assert (
        error_param(chat, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "add"}})
        == "tool_choice"
    )
    assert error_param(chat, tool_choice="required") == "tool_choice"
    assert error_param(chat, tools=[WEATHER], tool_choice="sometimes") == "tool_choice"
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}}
    assert (
        error_param(chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": big}})
        == "response_format.json_schema.schema"
    )
    with pytest.raises(APIError) as info:
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": big}})
    assert info.value.body()["error"]["code"] == "schema_too_large"
    assert error_param(chat, response_format={"type": "xml"}) == "response_format"
    assert (
        error_param(chat, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
        == "response_format"
    )
    assert error_param(chat, logprobs=True, top_logprobs=21) == "top_logprobs"
    assert error_param(chat, top_logprobs=2) == "top_logprobs"  # without logprobs: true
    assert (
        error_param(lambda **kw: parse_completion({"model": "m", "prompt": "x", **kw}, None), logprobs=21) == "logprobs"
    )
    with pytest.raises(APIError):
        parse_completion({"model": "m", "prompt": "x", "tools": [WEATHER]}, None)


def test_a_tool_name_with_a_trailing_newline_is_refused():
    """Issue 33 item 8: the name must match whole ($ would match before a final newline)."""
    for name in ("get_weather\n", "get_weather\r\n", "\nget_weather"):
        tool = {"type": "function", "function": {"name": name}}
        assert error_param(chat, tools=[tool]) == "tools[0].function.name", name


def test_logprobs_and_response_formats_parse():
    assert chat(logprobs=True, top_logprobs=5).params.logprobs == 5
    assert chat(logprobs=True).params.logprobs == 0 and chat().params.logprobs is None
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 3}, None).params.logprobs == 3
    fmt = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "strict": True, "schema": {"type": "object"}},
        }
    )
    assert fmt.response_format.kind == "json_schema" and fmt.constrained
    assert chat(response_format={"type": "json_object"}).response_format.kind == "json_object"
    assert chat(response_format={"type": "text"}).response_format is None


def test_history_with_calls_and_results_reaches_the_template_as_objects():
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    req = parse_chat({"model": "m", "messages": messages, "tools": [WEATHER]}, None)
    rendered = template_messages(req.messages)
    assert rendered[1]["content"] == "" and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    bad = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert error_param(lambda: parse_chat({"model": "m", "messages": bad}, None)) == "messages[1].tool_calls[0]"


def test_formats_come_from_the_template():
    assert detect_format("... {{ '<tool_call>\\n' }} ...") is HERMES
    assert detect_format('{"name": function name, "parameters": ...} <|start_header_id|>ipython') is LLAMA3_JSON
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None


def _pieces(fmt, text, names=("get_weather", "add"), seed=0):
    """(whole answer's deltas, deltas streamed in random pieces)."""
    whole = ToolCallParser(fmt, names)
    all_at_once = whole.feed(text) + whole.finish()
    rnd, parser, streamed, i = random.Random(seed), ToolCallParser(fmt, names), [], 0
    while i < len(text):
        j = i + rnd.randint(1, 5)
        streamed += parser.feed(text[i:j])
        i = j
    return all_at_once, streamed + parser.finish()


def _calls(deltas):
    content, calls = collect(deltas)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


HERMES_CASES = {
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "q": "}{\\""}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>': (
        "Checking.",
        [("get_weather", '{"city": "Paris", "q": "}{\\""}'), ("add", '{"a": 1, "b": 2}')],
    ),
    '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>': (None, [("add", '{"a": 1}')]),
    # looks like a call, but is not one in the format: text
    '{"name": "get_weather", "arguments": {"city": "Paris"}}': (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        [],
    ),
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>': (
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
        [],
    ),
    "Use the <tool_ tag, or <tool_call> alone": ("Use the <tool_ tag, or <tool_call> alone", []),
}


@pytest.mark.parametrize("text", list(HERMES_CASES))
def test_hermes_calls_stream_as_they_read_whole(text):
    whole, streamed = _pieces(HERMES, text)
    assert _calls(whole) == HERMES_CASES[text]
    for seed in range(10):
        assert _calls(_pieces(HERMES, text, seed=seed)[1]) == HERMES_CASES[text]


def test_a_call_is_sent_whole_once_complete_with_its_start_first():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France"}}\n</tool_call>'
    parser = ToolCallParser(HERMES, ["get_weather"])
    assert parser.feed(text[:-3]) == []  # the object is complete, its closing tag is not: not yet a call
    streamed = parser.feed(text[-3:]) + parser.finish()
    assert [type(d) for d in streamed] == [CallStart, CallArgs]
    assert streamed[0].id.startswith("call_") and streamed[0].index == 0 and streamed[0].name == "get_weather"
    assert json.loads(streamed[1].text) == {"city": "Paris, France"}


SCHEMAS = {
    "note": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _both(text, names=("note", "get_weather"), fmt=HERMES):
    """(content, calls, parser) of the whole answer, after checking that every streamed
    split of it gives the same deltas' content and calls."""
    whole = ToolCallParser(fmt, names, SCHEMAS)
    expected = _calls(whole.feed(text) + whole.finish())
    for seed in range(8):
        rnd, parser, streamed, i = random.Random(seed), ToolCallParser(fmt, names, SCHEMAS), [], 0
        while i < len(text):
            j = i + rnd.randint(1, 7)
            streamed += parser.feed(text[i:j])
            i = j
        assert _calls(streamed + parser.finish()) == expected, seed
        assert (parser.cut, parser.repeated, parser.calls) == (whole.cut, whole.repeated, whole.calls)
    return (*expected, whole)


def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call():
    """Issue 33 item 1: the call ends where its JSON object does."""
    text = (
        '<tool_call>\n{"name": "note", "arguments": {"text": "see </tool_call> here"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "note", "arguments": {"text": "<tool_call>{\\"x</tool_call>"}}</tool_call>'
    )
    content, calls, _ = _both(text)
    assert content is None and [json.loads(a)["text"] for _, a in calls] == [
        "see </tool_call> here",
        '<tool_call>{"x</tool_call>',
    ]


def test_a_cut_or_invalid_call_is_text_not_a_call():
    """Issue 33 item 2: only complete calls whose arguments fit the tool's schema are calls;
    an answer that ends inside a call (a stop string) is cut, and its finish is not tool_calls."""
    from ssdlocal.server.responses import finish_reason

    for cut in (
        '<tool_call>\n{"',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "c',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool',
    ):
        content, calls, parser = _both(cut)
        assert calls == [] and content == cut and parser.cut, cut
        assert finish_reason(FinishReason.STOP, parser=parser) == "stop"
    complete = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>'
    content, calls, parser = _both(complete + "\n" + cut)
    assert len(calls) == 1 and content == cut and finish_reason(FinishReason.STOP, parser=parser) == "stop"
    invalid = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>'
    assert _both(invalid)[:2] == (invalid, [])
    extra = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon", "x": 1}}\n</tool_call>'
    assert _both(extra)[:2] == (extra, [])


def test_a_repeated_call_ends_the_list():
    """Issue 33 item 7: a model that repeats an identical call has said all it had to say."""
    from ssdlocal.server.responses import finish_reason

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}}\n</tool_call>'
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "fahrenheit", "city": "Lisbon"}}\n</tool_call>'
    again = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius",  "city": "Lisbon"}}\n</tool_call>'
    content, calls, parser = _both("\n".join([one, two, again, two, one, '<tool_call>\n{"name']))
    assert content is None and len(calls) == 2 and parser.repeated and not parser.cut
    assert finish_reason(FinishReason.LENGTH, parser=parser) == "tool_calls"


def test_llama3_json_calls():
    cases = {
        '{"name": "add", "parameters": {"a": 1, "b": 2}}': (None, [("add", '{"a": 1, "b": 2}')]),
        ' {"name": "other", "parameters": {}}': (' {"name": "other", "parameters": {}}', []),
        'Here: {"name": "add", "parameters": {"a": 1}}': ('Here: {"name": "add", "parameters": {"a": 1}}', []),
        "Plain text.": ("Plain text.", []),
    }
    for text, expected in cases.items():
        whole, streamed = _pieces(LLAMA3_JSON, text)
        assert _calls(whole) == expected and _calls(streamed) == expected, text
    assert json.loads(_calls(_pieces(LLAMA3_JSON, '{"name": "add", "parameters": {"a": 1}}')[0])[1][0][1]) == {"a": 1}


def test_without_llguidance_constrained_requests_get_an_install_hint(monkeypatch):
    import sys
    from types import SimpleNamespace

    from ssdlocal.core.errors import UsageError
    from ssdlocal.grammar.compiler import require_llguidance
    from ssdlocal.server.grammars import RequestGrammars

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as if not installed
    with pytest.raises(UsageError) as info:
        require_llguidance()
    assert "pip install llguidance" in info.value.hint
    grammars = RequestGrammars(SimpleNamespace(chat_template=None), 384, [0])
    assert grammars.for_request(chat()) is None  # nothing to enforce: no engine needed
    with pytest.raises(APIError) as api:
        grammars.for_request(chat(response_format={"type": "json_object"}))
    body = api.value.body()["error"]
    assert api.value.status == 400 and body["param"] == "response_format" and "llguidance" in body["message"]
