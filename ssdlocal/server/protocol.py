"""OpenAI request bodies -> validated requests, and OpenAI's error body.

Parses the JSON of /v1/completions and /v1/chat/completions into a `ParsedRequest`
(prompts or messages, SamplingParams, n, stream options; a completion's `suffix`, which
makes it fill-in-the-middle; tools, tool_choice, response_format and logprobs through
structured.py) and raises `APIError` with
OpenAI's `{"error": {"message", "type", "param", "code"}}` for anything invalid or
unsupported, naming the offending field in `param`. Text must be valid Unicode (no
lone surrogates); error messages quote client values only shortened. Knows nothing of
HTTP frameworks, tokenizers or the engine.
"""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.errors import UsageError
from ssdlocal.server.structured import (
    FieldError,
    ResponseFormat,
    Tool,
    ToolChoice,
    parse_logprobs,
    parse_response_format,
    parse_tools,
)

MAX_N = 16  # choices per request
MAX_STOP_STRINGS = 16  # OpenAI allows 4; some editor plug-ins send more
MAX_STOP_CHARS = 64  # each stop string is searched in the answer after every round
_SURROGATE = re.compile("[\ud800-\udfff]")
RETRY_STATUSES = (429, 503)  # answers that say "later": each carries Retry-After
RETRY_AFTER_S = 5  # seconds, where the cause names no better wait


@dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"  # OpenAI's field name
    param: str | None = None
    code: str | None = None
    # extra response headers (e.g. Connection: close); a 429 or 503 without Retry-After
    # gets RETRY_AFTER_S
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        headers = self.headers
        if self.status in RETRY_STATUSES and not any(k.lower() == "retry-after" for k in headers or {}):
            self.headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    """One validated request. Exactly one of `prompts` (completions: text or token ids per
    prompt) and `messages` (chat) is set."""

    model: str
    params: SamplingParams  # seed 0 when the request gave none (see `seeded`)
    seeded: bool  # the request chose its seed
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    return_token_ids: bool  # vLLM's extra field: token ids in each choice
    max_tokens: int | None = None  # as the request gave it (None: absent; params hold the cap)
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[dict, ...] = ()  # role, content (text); tool_calls / tool_call_id where given
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    response_format: ResponseFormat | None = None
    # fill-in-the-middle (completions): the text after the cursor (None: a plain completion;
    # the prompt is the text before it), other files as context (engine.fim.ContextFile),
    # and whether the prompt names the repository and file even without them (/infill)
    suffix: str | None = None
    context_files: tuple = ()
    repo_level: bool = False

    @property
    def constrained(self) -> bool:
        """Whether the answer is held to a grammar (a JSON format, or a forced tool call)."""
        return self.response_format is not None or self.tool_choice.forced

    @property
    def chat(self) -> bool:
        return bool(self.messages)


# fields accepted only at their default value: name -> (default test, what to say)
_UNSUPPORTED = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "functions": lambda v: not v,
    "function_call": lambda v: v is None,
}


def parse_completion(body: Any, max_new_tokens: int | None) -> ParsedRequest:
    """A /v1/completions body: prompt is a string, a list of strings, a list of token
    ids, or a list of token-id lists."""
    body = _object(body)
    if body.get("tools"):
        raise bad("'tools' is a chat completions field: use /v1/chat/completions", param="tools", code="unsupported")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad("'suffix' must be a string: the text after the insertion point", param="suffix")
    suffix = suffix or None  # "": a plain completion, as before
    prompts = _prompts(body.get("prompt"), allow_empty=suffix is not None)
    if suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise bad(
            "'suffix' needs the prompt as text (the text before the insertion point), not token ids", param="suffix"
        )
    return _parse(body, max_new_tokens, prompts=prompts, suffix=suffix)


def parse_chat(body: Any, max_new_tokens: int | None) -> ParsedRequest:
    """A /v1/chat/completions body: messages with roles system | developer | user |
    assistant and text content (a string or a list of text parts)."""
    body = _object(body)
    messages = _messages(body.get("messages"))
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    try:
        tools, choice = parse_tools(body)
    except FieldError as exc:
        raise bad(exc.message, param=exc.param, code=exc.code) from None
    return _parse(body, max_new_tokens, messages=messages, tools=tools, tool_choice=choice)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_unicode(body)
    return body


def _check_unicode(body: dict) -> None:
    """Every string (keys too) is valid Unicode: JSON's \\ud800-style escapes can encode
    lone surrogates, which no tokenizer or UTF-8 encoder accepts. Iterative, so any
    nesting depth the JSON parser accepted is fine."""
    for key, value in body.items():
        stack = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if not item.isascii() and _SURROGATE.search(item):
                    raise bad(
                        f"'{_show_key(key)}' is not valid Unicode: it contains a lone surrogate "
                        "(a \\ud800-\\udfff escape without its pair); send UTF-8 text",
                        param=_show_key(key) if _SURROGATE.search(key) is None else None,
                    )
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def _show_key(key: str) -> str:
    return _SURROGATE.sub("?", key)[:64]


def _show(value: Any) -> str:
    """A client value for an error message: repr, at most 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse(body: dict, max_new_tokens: int | None, **what) -> ParsedRequest:
    """`max_new_tokens`: the server's cap on answers (None: the context bounds them)."""
    for name, is_default in _UNSUPPORTED.items():
        if name in body and not is_default(body[name]):
            raise bad(f"'{name}' is not supported by ssdlocal", param=name, code="unsupported")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: the id of a model from GET /v1/models", param="model")
    max_tokens = _int(body, "max_tokens", None, minimum=1)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"temperature must be >= 0, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = _int(body, "top_k", 0, minimum=-1)  # vLLM: -1 (or 0) = off
    seed = _int(body, "seed", None)
    n = _int(body, "n", 1, minimum=1)
    if n > MAX_N:
        raise bad(f"n must be at most {MAX_N}, got {n}", param="n")
    stop = _stop(body.get("stop"))
    try:
        logprobs = parse_logprobs(body, chat=bool(what.get("messages")))
        response_format = parse_response_format(body.get("response_format"))
    except FieldError as exc:
        raise bad(exc.message, param=exc.param, code=exc.code) from None
    if response_format is not None and what.get("tool_choice", ToolChoice("none")).forced:
        raise bad(
            "response_format cannot be combined with a forced tool_choice (the answer is a tool call)",
            param="response_format",
        )
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", param="stream_options")
    fields = {  # SamplingParams field -> (value, the request's field)
        "temperature": (temperature, "temperature"),
        "top_k": (max(top_k, 0), "top_k"),
        "top_p": (top_p, "top_p"),
        "seed": (0 if seed is None else seed, "seed"),
        "max_new_tokens": (_capped(max_tokens, max_new_tokens), "max_tokens"),
        "stop": (stop, "stop"),
    }
    for name, (value, param) in fields.items():  # SamplingParams' own rules, one field at a time
        try:
            SamplingParams(**{name: value})
        except UsageError as exc:
            raise bad(exc.message, param=param) from None
    values = {name: value for name, (value, _) in fields.items()}
    params = SamplingParams(**values, ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs)
    return ParsedRequest(
        model=model,
        params=params,
        seeded=seed is not None,
        n=n,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        return_token_ids=_bool(body, "return_token_ids"),
        max_tokens=max_tokens,
        response_format=response_format,
        **what,
    )


def _capped(asked: int | None, cap: int | None) -> int | None:
    """The request's max_tokens within the server's --max-new-tokens (its default too)."""
    if asked is None or cap is None:
        return cap if asked is None else asked
    return min(asked, cap)


def _int(body: dict, name: str, default, minimum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_show(value)}", param=name)
    if minimum is not None and value < minimum:
        raise bad(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {_show(value)}", param=name)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {_show(value)}", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed", param="stop")
    return tuple(stops)


def _prompts(value: Any, allow_empty: bool = False) -> tuple[str | tuple[int, ...], ...]:
    """`allow_empty`: an empty text prompt is fine (fill-in-the-middle at a file's start)."""

    def token_list(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        prompts: list = [value]
    elif token_list(value):
        prompts = [tuple(value)]
    elif isinstance(value, list) and value and all(isinstance(p, str) or token_list(p) for p in value):
        prompts = [p if isinstance(p, str) else tuple(p) for p in value]
    else:
        raise bad("'prompt' must be a string, a list of strings or a list of token ids", param="prompt")
    if not allow_empty and any(isinstance(p, str) and not p.strip() for p in prompts):
        raise bad("'prompt' must not be empty", param="prompt")
    return tuple(prompts)


def _messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"messages[{i}].role {_show(role)} is not supported: use system, user, assistant or tool",
                param=f"messages[{i}].role",
            )
        entry: dict = {"role": role, "content": _content(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], i)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(
                    f"messages[{i}].tool_call_id must be the id of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                )
            entry["tool_call_id"] = call_id
            if isinstance(message.get("name"), str):
                entry["name"] = message["name"]
        if message.get("function_call"):  # the legacy field: dropping it would change the conversation
            raise bad(
                f"messages[{i}].function_call is not supported: send tool_calls", param=f"messages[{i}].function_call"
            )
        out.append(entry)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise bad("the messages have no text", param="messages")
    return tuple(out)


def _tool_calls(value: Any, i: int) -> list[dict]:
    """An assistant message's earlier calls: [{"id", "type": "function", "function":
    {"name", "arguments" (a JSON string)}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise bad(f"{where} must be a list of calls", param=where)
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise bad(
                f'{where}[{j}] must be {{"id", "type": "function", "function": '
                f'{{"name", "arguments": a JSON string}}}}',
                param=f"{where}[{j}]",
            )
        call_id = call.get("id")
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{i}_{j}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return calls


def _content(value: Any, i: int) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"messages[{i}].content: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
