"""The agent-facing fields of a request: tools, tool_choice, response_format and logprobs.

Parsed and validated into frozen values (`Tool`, `ToolChoice`, `ResponseFormat`), raising
FieldError (an OpenAI error body with `param`, from protocol.py) for the offending field: too many tools, a tool whose
`parameters` is not a JSON schema, a named `tool_choice` that is not among the tools, a
schema over the size bound, `top_logprobs` over 20. Whether a grammar engine can enforce a
schema is decided when it is compiled (server/tools.py). Knows nothing of HTTP or models.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ssdlocal.core.config import MAX_TOP_LOGPROBS
from ssdlocal.grammar.compiler import GrammarLimits
from ssdlocal.grammar.kinds import GrammarKind

MAX_TOOLS = 64  # tools per request
MAX_SCHEMA_CHARS = GrammarLimits.max_chars  # one schema's JSON (a tool's parameters, a response format)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # the whole name (fullmatch: no trailing newline)
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class FieldError(Exception):
    """A field of the request is invalid; protocol.py answers it with a 400 naming `param`."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _bad(message: str, param: str | None = None, code: str | None = None) -> FieldError:
    return FieldError(message, param, code)


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: dict  # a JSON schema for the arguments object
    description: str | None = None

    def as_template(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """ "none" | "auto" | "required" | "function" (then `name` is the one function)."""

    mode: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: a forced answer may hold several calls

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ResponseFormat:
    """{"type": "json_object"} or {"type": "json_schema", ...} (its `schema`)."""

    kind: GrammarKind  # JSON_OBJECT or JSON_SCHEMA
    schema: dict | None = None
    name: str | None = None


def parse_tools(body: dict) -> tuple[tuple[Tool, ...], ToolChoice]:
    value = body.get("tools")
    tools: list[Tool] = []
    if value is not None:
        if not isinstance(value, list):
            raise _bad('\'tools\' must be a list of {"type": "function", "function": {...}}', param="tools")
        if len(value) > MAX_TOOLS:
            raise _bad(f"'tools' has {len(value)} tools; at most {MAX_TOOLS} are allowed", param="tools")
        for i, item in enumerate(value):
            tools.append(_tool(item, f"tools[{i}]"))
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise _bad(f"two tools are named {dup!r}; tool names must be unique", param="tools")
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad(
                f"'parallel_tool_calls' must be true or false, got {_show(parallel)}", param="parallel_tool_calls"
            )
        choice = ToolChoice(choice.mode, choice.name, parallel)
    return tuple(tools), choice


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise _bad(f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}', param=where)
    function = item["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(
            f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {_show(name)}",
            param=f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_schema(parameters, f"{where}.function.parameters", root_type="object")
    return Tool(name, parameters, description)


def check_schema(schema: Any, param: str, root_type: str | None = None) -> None:
    """A structural check that `schema` is a JSON schema (the grammar engine checks the rest)."""
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON schema (an object), got {_show(schema)}", param=param)
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise _bad(
            f"{param} has {size:,} characters; at most {MAX_SCHEMA_CHARS:,} are allowed",
            param=param,
            code="schema_too_large",
        )
    stack = [(schema, param)]
    while stack:
        node, where = stack.pop()
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        if not all(isinstance(k, str) and k in _TYPES for k in kinds):
            raise _bad(
                f"{where}.type must be one of {', '.join(sorted(_TYPES))} (or a list of them), got {_show(kind)}",
                param=param,
            )
        props = node.get("properties")
        if props is not None:
            if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
                raise _bad(f"{where}.properties must map names to schemas", param=param)
            stack.extend((v, f"{where}.properties.{k}") for k, v in props.items())
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise _bad(f"{where}.required must be a list of property names", param=param)
        items = node.get("items")
        if isinstance(items, dict):
            stack.append((items, f"{where}.items"))
        elif items is not None and not isinstance(items, bool):
            raise _bad(f"{where}.items must be a schema", param=param)
    if root_type is not None and schema.get("type") not in (None, root_type):
        raise _bad(f"{param} must describe an {root_type} (its type is {_show(schema.get('type'))})", param=param)


def _tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _bad(
                f"tool_choice must be none, auto, required or a function, got {_show(value)}", param="tool_choice"
            )
        if value == "required" and not tools:
            raise _bad("tool_choice 'required' needs 'tools'", param="tool_choice")
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _bad(
            'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t.name for t in tools}:
        raise _bad(f"tool_choice names {_show(name)}, which is not in 'tools'", param="tool_choice")
    return ToolChoice("function", name)


def parse_response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind not in (GrammarKind.JSON_OBJECT, GrammarKind.JSON_SCHEMA):  # the wire's word -> the member
        raise _bad("response_format.type must be text, json_object or json_schema", param="response_format")
    if GrammarKind(kind) is GrammarKind.JSON_OBJECT:
        return ResponseFormat(GrammarKind.JSON_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad("response_format.json_schema.name must be a string", param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(
            "response_format.json_schema.strict must be true or false", param="response_format.json_schema.strict"
        )
    schema = spec.get("schema")
    if schema is None:
        schema = {"type": "object"}
    check_schema(schema, "response_format.json_schema.schema")
    return ResponseFormat(GrammarKind.JSON_SCHEMA, schema, name)


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token (0..20), or None when no log-probabilities are asked for.
    Chat: `logprobs` true/false and `top_logprobs`; completions: `logprobs` N."""
    if chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise _bad(f"'logprobs' must be true or false, got {_show(wanted)}", param="logprobs")
        if top is not None:
            top = _count(top, "top_logprobs")
            if not wanted:
                raise _bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    return _count(value, "logprobs")


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"'{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {_show(value)}", param=name)
    if value > MAX_TOP_LOGPROBS:
        raise _bad(f"'{name}' must be at most {MAX_TOP_LOGPROBS}, got {value}", param=name)
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
