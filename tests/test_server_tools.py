"""Agents' requests against a live server on tiny models, through the official client: tool
calls (forced, named, streamed, a full round trip), JSON response formats, logprobs, and the
errors for what cannot be served — in SD and SSD, whose answers must equal AR's.

The tiny models are random, so what they "choose" to call is arbitrary; what is checked is
what the server guarantees: a forced call is a call of an offered function whose arguments
validate against its schema, a JSON format's answer validates, streamed pieces add up to the
whole answer, and log-probabilities are the target's own (computed again with transformers).
"""

from __future__ import annotations

import json

import pytest
import torch

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
from support.chat_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, with_template
from support.drafts import draft_of
from support.grammar_children import hanging_serve
from support.server import MODEL, LiveServer

from ssdlocal.grammar.pool import CompilePool
from ssdlocal.server.tools import MAX_FORCED_CALLS

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes_dirs(tiny_dir, tmp_path_factory):
    return with_template(tiny_dir, tmp_path_factory, HERMES_TEMPLATE, "hermes")


def start(dirs, mode: Mode, **kw) -> LiveServer:
    spec = SpecConfig(mode=mode, k=3, draft=draft_of(str(dirs["draft_llama"])), **kw)
    return LiveServer(EngineConfig(ModelSpec(str(dirs["llama"]), dtype="float32"), spec, pin_cpus=False))


@pytest.fixture(scope="module", params=["sd", "ssd"])
def server(request, hermes_dirs):
    live = start(hermes_dirs, Mode(request.param))
    yield live
    live.close()
    live.engine.close()


def ask(server, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 400)  # a random model writes all the whitespace a grammar allows
    return server.client.chat.completions.create(model=MODEL, **kw)


def assert_valid_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_return_valid_calls(server):
    required = ask(server, messages=USER, tools=TOOLS, tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    single = ask(server, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
    named = ask(server, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]
    assert_valid_call(calls[0])
    assert named.model_extra["ssdlocal"]["constrained"] is True
    assert named.model_extra["ssdlocal"]["mask_ms_per_token"] > 0


def test_streamed_calls_add_up_to_the_whole_answer(server):
    kw = dict(messages=USER, tools=TOOLS, tool_choice="required")
    whole = ask(server, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    pieces = 0
    finish = None
    for chunk in ask(server, stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    entry["id"], entry["name"] = delta.id, delta.function.name
                if delta.function and delta.function.arguments:
                    entry["arguments"] += delta.function.arguments
                    pieces += 1
    assert finish == "tool_calls" and pieces == len(calls) >= 1  # each call is sent once complete and valid
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_json_schema_and_json_object_answers_validate(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER}}
    answer = ask(server, messages=USER, response_format=fmt, max_tokens=200)
    assert answer.choices[0].finish_reason == "stop", answer
    jsonschema.validate(json.loads(answer.choices[0].message.content), ANSWER)
    any_object = ask(server, messages=USER, response_format={"type": "json_object"}, max_tokens=6)
    assert any_object.choices[0].finish_reason == "length"  # cut: never claimed complete
    assert any_object.choices[0].message.content.lstrip().startswith("{")


def test_a_full_tool_round_trip(server):
    first = ask(
        server, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    call = first.choices[0].message.tool_calls[0]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = ask(server, messages=history, tools=TOOLS, max_tokens=8)
    assert final.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered
    plain = ask(server, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert plain.choices[0].message.tool_calls is None and plain.usage.prompt_tokens < first.usage.prompt_tokens


def test_speculative_answers_equal_ar(server, hermes_dirs):
    kw = dict(messages=USER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    ar = start(hermes_dirs, Mode.AR)
    try:
        for extra in ({}, {"tool_choice": "auto", "response_format": fmt}):
            want = ar.client.chat.completions.create(model=MODEL, **{**kw, **extra})
            got = server.client.chat.completions.create(model=MODEL, **{**kw, **extra})
            assert got.choices[0].message.model_dump(exclude={"tool_calls"}) == want.choices[0].message.model_dump(
                exclude={"tool_calls"}
            )
            strip = lambda m: [(c.function.name, c.function.arguments) for c in m.tool_calls or []]  # noqa: E731
            assert strip(got.choices[0].message) == strip(want.choices[0].message)
    finally:
        ar.close()
        ar.engine.close()


def test_logprobs_are_the_targets_own(server, hermes_dirs):
    """Chat logprobs (top 3) and completions logprobs:2, whole and streamed, equal
    log_softmax of the target's logits computed again with transformers."""
    from transformers import AutoModelForCausalLM

    res = ask(server, messages=USER, logprobs=True, top_logprobs=3, max_tokens=10)
    entries = res.choices[0].logprobs.content
    ids = server.engine.tokenizer.encode(
        server.engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    stream = ask(server, messages=USER, logprobs=True, top_logprobs=3, max_tokens=10, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    done = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2, extra_body={"return_token_ids": True}
    )
    generated = done.choices[0].model_extra["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(hermes_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1)  # [T, V]
    got = done.choices[0].logprobs
    assert len(got.token_logprobs) == len(generated) == 6 and len(entries) == 10
    for t, token in enumerate(generated):
        assert abs(got.token_logprobs[t] - float(expected[t, token])) < 1e-4
        top2 = torch.topk(expected[t], 2).values.tolist()
        assert 1 <= len(got.top_logprobs[t]) <= 2  # keyed by token text: two may share one
        assert all(min(abs(v - w) for w in top2) < 1e-4 for v in got.top_logprobs[t].values())
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob


def test_what_cannot_be_served_is_a_400_naming_the_field(server):
    cases = [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}},
                }
            ),
            "response_format.json_schema.schema",
            "not",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
            "response_format.json_schema.schema",
            None,
        ),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
                tool_choice="required",
            ),
            "tools[0].function.parameters",
            "uniqueItems",
        ),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", None),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", None),
    ]
    for extra, param, named in cases:
        with pytest.raises(openai.BadRequestError) as info:
            ask(server, messages=USER, **extra)
        assert info.value.body["param"] == param, info.value.body
        if named:
            assert named in info.value.body["message"]
    compiler = server.state.grammars.compiler
    limits, pool = compiler.limits, compiler.pool
    hanging = CompilePool(compiler.tokenizer, compiler.vocab_size, compiler.eos_ids, serve=hanging_serve)
    try:  # a grammar over the compile time limit is refused (its compile killed), the server goes on
        hanging.start()
        with hanging.slot(1.0):
            hanging.check("regex", "ready?", 120)
        compiler.limits, compiler.pool = type(limits)(compile_timeout_s=0.5), hanging
        fresh = {"type": "object", "properties": {"zz": {"type": "string", "maxLength": 7}}, "title": "HANG"}
        with pytest.raises(openai.BadRequestError) as info:
            ask(
                server,
                messages=USER,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": fresh}},
            )
        assert info.value.body["code"] == "grammar_too_complex" and hanging.killed == 1
    finally:
        compiler.limits, compiler.pool = limits, pool
        hanging.close()
    assert ask(server, messages=USER, max_tokens=2).choices[0].finish_reason == "length"


def _stream(server, **kw):
    """(content, {index: (name, arguments)}, finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in ask(server, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_forced_calls_are_whole_valid_calls(server):
    """Issue 33 items 1, 2 and 7: a closing tag inside an argument string, a stop string
    inside a forced call, and required calls with parallel calls allowed."""
    note = {"type": "object", "properties": {"text": {"const": "see </tool_call> here"}}, "required": ["text"]}
    tools = [{"type": "function", "function": {"name": "note", "parameters": note}}]
    named = {"type": "function", "function": {"name": "note"}}
    whole = ask(server, messages=USER, tools=tools, tool_choice=named).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [{"text": "see </tool_call> here"}]
    content, calls, finish = _stream(server, messages=USER, tools=tools, tool_choice=named)
    assert (
        finish == "tool_calls"
        and not content
        and [json.loads(a) for _, a in calls.values()] == [{"text": "see </tool_call> here"}]
    )
    weather = TOOLS[:1]
    for stop in (["city"], ["elsius"], ["unit"]):
        cut = ask(server, messages=USER, tools=weather, tool_choice="required", stop=stop).choices[0]
        for call in cut.message.tool_calls or ():
            assert_valid_call(call)
        if cut.finish_reason == "tool_calls":
            assert cut.message.tool_calls, cut
        else:  # cut inside a call: text, and the reason it ended
            assert cut.finish_reason == "stop" and "<tool_call>" in cut.message.content, cut
        content, calls, finish = _stream(server, messages=USER, tools=weather, tool_choice="required", stop=stop)
        assert finish == cut.finish_reason and content == (cut.message.content or "")
        assert [a for _, a in calls.values()] == [c.function.arguments for c in cut.message.tool_calls or ()]
    many = ask(server, messages=USER, tools=weather, tool_choice="required", max_tokens=1500).choices[0]
    arguments = [c.function.arguments for c in many.message.tool_calls]
    assert many.finish_reason == "tool_calls" and 1 <= len(arguments) <= MAX_FORCED_CALLS, many
    assert len({json.dumps(json.loads(a), sort_keys=True) for a in arguments}) == len(arguments)  # no repeats


def test_a_grammar_that_fails_mid_answer_fails_only_its_own_choice(server):
    """Issue 33 items 3 and 4: the request whose pattern the grammar engine gives up on gets
    an error (400 grammar_failed; in a stream, an error event), the plain chats beside it
    their answers; the same grammar is then refused before any token."""
    import threading

    def hostile(letter):
        pattern = "^" + f"{letter}?" * 2000 + letter * 2000 + "$"
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    plain, failures = [], []

    def chat(i):
        plain.append(ask(server, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=8).choices[0])

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        ask(server, messages=USER, response_format=hostile("a"))
    except openai.BadRequestError as exc:
        failures.append(exc.body)
    for t in threads:
        t.join(120)
    assert len(plain) == 3 and all(c.finish_reason in ("stop", "length") for c in plain), plain
    assert failures and failures[0]["code"] == "grammar_failed" and "too many expressions" in failures[0]["message"]
    assert failures[0]["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as again:
        ask(server, messages=USER, response_format=hostile("a"))
    assert again.value.body["code"] == "grammar_too_complex"
    with pytest.raises(openai.APIError) as streamed:
        _stream(server, messages=USER, response_format=hostile("b"))
    assert "too many expressions" in str(streamed.value)
    assert ask(server, messages=USER, max_tokens=2).choices[0].finish_reason == "length"


def test_a_template_without_a_tool_format_refuses_tools(tiny_dir):
    live = LiveServer(EngineConfig(ModelSpec(str(tiny_dir["llama"]), dtype="float32"), SpecConfig(mode=Mode.AR)))
    try:
        with pytest.raises(openai.BadRequestError) as info:
            ask(live, messages=USER, tools=TOOLS)
        assert info.value.body["param"] == "tools"
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
        jsonschema.validate(
            json.loads(ask(live, messages=USER, response_format=fmt, max_tokens=200).choices[0].message.content), ANSWER
        )
    finally:
        live.close()
        live.engine.close()


def test_llama3_json_calls(tiny_dir, tmp_path_factory):
    dirs = with_template(tiny_dir, tmp_path_factory, LLAMA3_TEMPLATE, "llama3")
    live = start(dirs, Mode.SD)
    try:
        res = ask(live, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
        assert res.choices[0].finish_reason == "tool_calls"
        assert_valid_call(res.choices[0].message.tool_calls[0])
    finally:
        live.close()
        live.engine.close()
