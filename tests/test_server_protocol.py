"""Request validation of the server, without a server: OpenAI fields -> SamplingParams,
the --max-new-tokens cap, APIError bodies for bad or unsupported fields (naming them),
bounds on stop strings, lone surrogates; and how a job is split into engine calls."""

from __future__ import annotations

import pytest

from ssdlocal.server.protocol import APIError, parse_chat, parse_completion


def test_max_tokens_within_the_servers_cap():
    def max_new(body_max, cap):
        body = {"model": "m", "prompt": "hi"}
        if body_max is not None:
            body["max_tokens"] = body_max
        return parse_completion(body, cap).params.max_new_tokens

    assert max_new(None, None) is None  # until end-of-sequence, bounded by the context
    assert max_new(50, None) == 50
    assert max_new(None, 64) == 64  # the cap is the default ...
    assert max_new(500, 64) == 64  # ... and the bound
    assert max_new(10, 64) == 10


def test_openai_defaults_and_vllm_extras():
    req = parse_completion(
        {"model": "m", "prompt": ["a", [1, 2, 3]], "top_k": -1, "ignore_eos": True, "stop": "\n", "n": 2}, None
    )
    assert req.prompts == ("a", (1, 2, 3)) and req.n == 2
    assert req.params.temperature == 1.0 and req.params.top_k == 0 and req.params.ignore_eos
    assert req.params.stop == ("\n",) and not req.seeded
    chat = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "max_completion_tokens": 7,
            "seed": 3,
        },
        None,
    )
    assert chat.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    assert chat.params.max_new_tokens == 7 and chat.seeded and chat.params.seed == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"model": "m", "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "hi", "n": 0}, "n"),
        ({"model": "m", "prompt": "hi", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": "hi", "echo": True}, "echo"),
        ({"model": "m", "prompt": "hi", "frequency_penalty": 1.0}, "frequency_penalty"),
    ],
)
def test_bad_fields_name_themselves(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body, None)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_bad_messages():
    for messages, param in (
        ([], "messages"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ):
        with pytest.raises(APIError) as info:
            parse_chat({"model": "m", "messages": messages}, None)
        assert info.value.body()["error"]["param"] == param


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("inf")),
        ("temperature", 1e-9),
        ("temperature", float("nan")),
        ("seed", -1),
        ("seed", 2**64),
        ("top_p", float("nan")),
    ],
)
def test_sampling_errors_name_their_field(field, value):
    with pytest.raises(APIError) as info:
        parse_completion({"model": "m", "prompt": "hi", field: value}, None)
    assert info.value.status == 400 and info.value.param == field, info.value.message


def test_stop_strings_are_bounded():
    assert parse_completion({"model": "m", "prompt": "hi", "stop": ["x" * 64] * 16}, None).params.stop
    for stop in (["a"] * 17, "x" * 65, [f"s{i}" for i in range(100_000)]):
        with pytest.raises(APIError) as info:
            parse_completion({"model": "m", "prompt": "hi", "stop": stop}, None)
        assert info.value.param == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "a\ud800b"}, "prompt"),
        ({"model": "\ud800", "prompt": "ab"}, "model"),
        ({"model": "m", "prompt": ["ok", "\udfff"]}, "prompt"),
        ({"model": "m", "prompt": "ab", "stop": [[["\ud800"]]]}, "stop"),
        ({"model": "m", "prompt": "ab", "x\ud800": 1}, None),
    ],
)
def test_lone_surrogates_are_invalid_requests(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body, None)
    err = info.value.body()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    err["message"].encode("utf-8")  # the error itself is valid text


def test_a_job_becomes_one_request_per_row_with_its_own_budget():
    import asyncio

    from ssdlocal.core.config import SamplingParams
    from ssdlocal.server.scheduler import Job

    loop = asyncio.new_event_loop()

    def requests(params, seeded, budgets):
        return Job(((1,),) * len(budgets), params, seeded, loop, budgets=tuple(budgets)).requests

    greedy = SamplingParams(temperature=0, seed=5, max_new_tokens=64)
    got = requests(greedy, False, [None, None, 64])
    assert [r.params.max_new_tokens for r in got] == [None, None, 64]
    assert all(r.exclusive is None and r.settings == ("greedy",) for r in got)  # greedy rows join anything
    sampled = SamplingParams(temperature=1, seed=5, max_new_tokens=8)
    seeded = requests(sampled, True, [8] * 3)
    assert seeded[0].params.seed == 5 and len({r.params.seed for r in seeded}) == 3  # rows do not repeat each other
    assert len({r.exclusive for r in seeded}) == 1 and seeded[0].exclusive is not None  # together, and alone
    assert len({r.settings for r in seeded}) == 1  # one random stream of their own
    other = requests(sampled, True, [8])
    assert other[0].exclusive != seeded[0].exclusive and other[0].settings != seeded[0].settings
    unseeded = requests(sampled, False, [8] * 2)
    assert all(r.exclusive is None for r in unseeded) and unseeded[0].settings == (1, 0, 1.0)
    loop.close()


def test_an_assistant_message_with_tool_calls_is_kept_and_a_legacy_function_call_refused():
    """`content: null` plus tool calls must reach the template as the calls, never as an
    empty turn; the legacy `function_call` field, which is not rendered, is refused."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "user", "content": "and now?"},
    ]
    parsed = parse_chat({"model": "m", "messages": messages}, None).messages
    assert parsed[1]["tool_calls"] == calls and parsed[1]["content"] == ""
    legacy = [*messages[:1], {"role": "assistant", "content": None, "function_call": calls[0]["function"]}]
    with pytest.raises(APIError) as info:
        parse_chat({"model": "m", "messages": legacy}, None)
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["param"] == "messages[1].function_call", error
    assert parse_chat(
        {"model": "m", "messages": [*messages[:1], {"role": "assistant", "content": None, "tool_calls": []}]}, None
    )  # empty: nothing lost
