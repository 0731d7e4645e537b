"""Tool-call formats: which one a model's chat template speaks, the grammar that makes the
model call a tool in it, and the conversation rendered the way the template expects.

| format | families | what the model writes |
|---|---|---|
| `hermes` | Qwen2.5, Qwen3, Hermes and other templates with `<tool_call>` | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more (forced: at most MAX_FORCED_CALLS) |
| `llama3_json` | Llama 3.1 - 3.3 | `{"name": ..., "parameters": {...}}` (one call) |

The format is chosen from the template's own text; a template with neither has no tool
format, and a request with tools is refused for it. tool_parse.py reads the model's output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ssdlocal.grammar.compiler import WHITESPACE, GrammarCompiler, GrammarError
from ssdlocal.grammar.kinds import GrammarKind
from ssdlocal.server.structured import FieldError, ResponseFormat, Tool, ToolChoice


MAX_FORCED_CALLS = 8  # calls in one forced answer (parallel_tool_calls); a repeated call ends it sooner


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes a tool call."""

    name: str
    args_key: str  # the call object's key for the arguments
    open_tag: str | None = None  # text around each call (None: the call is the whole answer)
    close_tag: str | None = None
    multiple: bool = True  # several calls in one answer

    def call_schema(self, tool: Tool) -> dict:
        """The JSON schema of one call of `tool` in this format."""
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.args_key: tool.parameters},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }


HERMES = ToolFormat("hermes", "arguments", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", multiple=False)
FORMATS = (HERMES, LLAMA3_JSON)


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template renders and expects, or None."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HERMES
    if '"parameters"' in chat_template and ("ipython" in chat_template or "<|python_tag|>" in chat_template):
        return LLAMA3_JSON
    return None


def require_format(chat_template: str | None) -> ToolFormat:
    fmt = detect_format(chat_template)
    if fmt is None:
        raise FieldError(
            "the served model's chat template has no tool-call format ssdlocal recognises "
            "(Hermes-style <tool_call> or Llama 3 JSON calls), so it cannot be offered tools",
            "tools",
        )
    return fmt


# ---------------------------------------------------------------------- grammar
def forced_grammar_text(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    choice: ToolChoice,
    compiler: GrammarCompiler,
    answer: ResponseFormat | None = None,
) -> str:
    """Lark text (llguidance's dialect) for an answer that is a tool call: one of the named
    function (tool_choice "function"), or one to MAX_FORCED_CALLS of any tool ("required";
    one with parallel_tool_calls false); with tool_choice "auto" and a JSON response
    format, either calls or that JSON answer. End-of-sequence may follow any complete
    call, and must follow the last one allowed: a forced answer always ends in calls."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    lines = []
    bodies = []
    for i, tool in enumerate(chosen):
        lines.append(f"body{i}: %json {_embedded(fmt.call_schema(tool))}")
        bodies.append(f"body{i}")
    lines.append("body: " + " | ".join(bodies))
    if fmt.open_tag is not None:
        lines.append(f'call: {_literal(fmt.open_tag, compiler)} "\\n" body "\\n" {_literal(fmt.close_tag, compiler)}')
    else:
        lines.append("call: body")
    lines.append(
        f'calls: call ("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}' if several_calls(fmt, choice) else "calls: call"
    )
    if answer is not None and choice.mode == "auto":
        schema = answer.schema if answer.kind is GrammarKind.JSON_SCHEMA else {"type": "object"}
        lines.append(f"answer: %json {_embedded(schema)}")
        lines.insert(0, "start: calls | answer")
    else:
        lines.insert(0, "start: calls")
    return "\n".join(lines)


def several_calls(fmt: ToolFormat, choice: ToolChoice) -> bool:
    """Whether a forced answer may hold more than one call (then calllist.CallList ends it
    at a repeated call)."""
    return fmt.multiple and choice.mode != "function" and choice.parallel


def _embedded(schema: dict) -> str:
    """A schema for `%json`, with the JSON layout options the compiler uses."""
    options = {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}
    return json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _literal(tag: str, compiler: GrammarCompiler) -> str:
    """A tag in Lark: its single token (`<[id]>`) when the vocabulary has one, else text."""
    token = compiler.special_token(tag)
    return f"<[{token}]>" if token is not None else json.dumps(tag)


def compile_forced(fmt, tools, choice, compiler, answer=None):
    """The Grammar for forced_grammar_text; a schema the engine refuses is blamed on its tool."""
    for i, tool in enumerate(tools):  # name the tool whose parameters cannot be enforced
        if choice.mode == "function" and tool.name != choice.name:
            continue
        try:
            compiler.json_schema(tool.parameters)
        except GrammarError as exc:
            if exc.reason == "busy":
                raise
            raise FieldError(
                f"tools[{i}].function.parameters: {exc.message}", f"tools[{i}].function.parameters"
            ) from None
    return compiler.lark(forced_grammar_text(fmt, tools, choice, compiler, answer))


# ---------------------------------------------------------------------- rendering
def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates take them: a tool call's arguments as an object (the
    request carries them as a JSON string), everything else as given."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(dict(message))
            continue
        rendered = []
        for call in calls:
            function = dict(call["function"])
            try:
                function["arguments"] = json.loads(function["arguments"])
            except (TypeError, ValueError):
                pass  # not JSON: the template gets the text as it came
            rendered.append({**call, "function": function})
        out.append({**message, "tool_calls": rendered})
    return out
