"""Tool calls read out of a model's answer, as it streams or whole: one parser for both.

`ToolCallParser(fmt, names, schemas)` takes the answer's text in pieces (`feed`) and at its
end (`finish`) and returns what to send: content text, and each call (its start: id and
name; then its arguments) once the call is complete. A call's end is found by the JSON
structure of its object (brackets outside strings), never by searching for the closing
tag, so a `</tool_call>` inside an argument string is just text. A call is reported only
when its object is complete, names one of the tools and its arguments validate against
that tool's schema; anything else that looks like a call stays content, and an answer
that ends inside a call (a stop string, max_tokens) is `cut`, not a call. A call identical
to an earlier one of the same answer ends the list (a model repeating itself): it and
everything after it are dropped (`repeated`). A whole answer is the same deltas as a
stream, joined, so the two always agree. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ssdlocal.server.tools import ToolFormat


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # the call's arguments as JSON text


Delta = Content | CallStart | CallArgs


class _Scanner:
    """Where a JSON value ends: depth of brackets outside strings, char by char."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.seen = False  # the value has begun
        self.first = ""  # its first character
        self.done = False
        self.pos = 0  # characters consumed

    def feed(self, text: str) -> None:
        """Scan text[self.pos:] until the value ends (text grows between calls)."""
        i = self.pos
        while i < len(text) and not self.done:
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif ch in " \t\r\n" and not self.seen:
                continue
            else:
                if not self.seen:
                    self.seen, self.first = True, ch
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    self.done = self.depth <= 0
                elif self.depth == 0 and ch == ",":
                    self.done = True
                    i -= 1
        self.pos = i


class ToolCallParser:
    """Incremental reader of one answer in format `fmt`, for the tools named `names`;
    `schemas` (name -> the tool's parameters schema) are checked when jsonschema is
    installed (a pip dependency of the "serve" extra)."""

    def __init__(self, fmt: ToolFormat, names, schemas: dict | None = None) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.schemas = schemas or {}
        self.calls = 0  # calls reported
        self.cut = False  # the answer ended inside a call
        self.repeated = False  # a call repeated an earlier one: the rest was dropped
        self._seen: set[tuple[str, str]] = set()
        self._pending = ""  # text not yet classified
        self._call: _Scanner | None = None  # the call being read (its text is self._body)
        self._body = ""
        self._decided = fmt.open_tag is not None  # untagged formats: is the answer a call at all?

    def feed(self, text: str) -> list[Delta]:
        if self.repeated:
            return []
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        if self.repeated:
            return []
        out = self._advance(final=True)
        if self._call is not None:  # the answer ended inside a call: it is text, and cut
            self.cut = True
            out.append(Content((self.fmt.open_tag or "") + self._body))
            self._call = None
        if self._pending:
            out.append(Content(self._pending))
            self._pending = ""
        return out

    # ------------------------------------------------------------------ states
    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while not self.repeated:
            if self._call is not None:
                if not self._in_call(out, final):
                    break
            elif not self._in_text(out, final):
                break
        return out

    def _in_text(self, out: list[Delta], final: bool) -> bool:
        """Text outside calls; True when a call began (the loop goes on)."""
        tag = self.fmt.open_tag
        if tag is None:  # the answer is a call iff it starts with '{'
            if not self._decided:
                stripped = self._pending.lstrip()
                if not stripped and not final:
                    return False
                self._decided = True
                if stripped.startswith("{"):
                    self._begin()
                    return True
            if self._pending:
                out.append(Content(self._pending))
                self._pending = ""
            return False
        at = self._pending.find(tag)
        if at >= 0:
            before = self._pending[:at]
            if before.strip() or not self.calls:  # whitespace between calls is not content
                if before:
                    out.append(Content(before))
            self._pending = self._pending[at + len(tag) :]
            self._begin()
            return True
        keep = 0 if final else _partial_suffix(self._pending, tag)
        text = self._pending[: len(self._pending) - keep]
        if text and (text.strip() or not self.calls):
            out.append(Content(text))
        self._pending = self._pending[len(text) :]
        return False

    def _begin(self) -> None:
        self._call, self._body = _Scanner(), ""

    def _in_call(self, out: list[Delta], final: bool) -> bool:
        """Inside a call; True when it ended (the loop goes on with the rest)."""
        scan, close = self._call, self.fmt.close_tag
        self._body += self._pending
        self._pending = ""
        scan.feed(self._body)
        if scan.seen and scan.first != "{":  # not a call object: text up to the closing tag
            return self._not_a_call(out, final)
        if not scan.done:
            return False
        end = scan.pos  # the object is self._body[:end]
        rest = self._body[end:]
        if close is not None:
            after = rest.lstrip()
            if not after.startswith(close):
                if close.startswith(after):
                    return False  # the closing tag may still come (at the end: the call is cut)
                return self._not_a_call(out, final)
            rest = after[len(close) :]
        text, raw = self._body[:end], (self.fmt.open_tag or "") + self._body[: len(self._body) - len(rest)]
        self._call, self._body, self._pending = None, "", rest
        self._report(text, raw, out)
        return True

    def _not_a_call(self, out: list[Delta], final: bool) -> bool:
        """What followed the tag is not a call in the format: content, through the closing
        tag (searched as text) when there is one."""
        close = self.fmt.close_tag
        at = self._body.find(close) if close is not None else -1
        if at < 0 and not final:
            return False
        upto = len(self._body) if at < 0 else at + len(close)
        out.append(Content((self.fmt.open_tag or "") + self._body[:upto]))
        self._call, self._pending, self._body = None, self._body[upto:], ""
        return True

    def _report(self, text: str, raw: str, out: list[Delta]) -> None:
        """A complete call object: a call when it names a tool and its arguments are
        valid; a repeat of an earlier call ends the list; otherwise content."""
        parsed = _call_object(text)
        if parsed is None or parsed[0] not in self.names or not self._valid(*parsed):
            out.append(Content(raw))
            return
        key = (parsed[0], json.dumps(json.loads(parsed[1]), sort_keys=True))
        if key in self._seen:
            self.repeated = True
            self._pending = ""
            return
        self._seen.add(key)
        index = self.calls
        self.calls += 1
        out += [CallStart(index, "call_" + uuid.uuid4().hex[:24], parsed[0]), CallArgs(index, parsed[1])]

    def _valid(self, name: str, arguments: str) -> bool:
        schema = self.schemas.get(name)
        if schema is None:
            return True
        try:
            import jsonschema
        except ImportError:  # pragma: no cover - the serve extra installs it
            return True
        try:  # patterns are left to the grammar: Python's re backtracks without bound
            jsonschema.validate(json.loads(arguments), _without_patterns(schema))
        except jsonschema.ValidationError:
            return False
        except jsonschema.SchemaError:
            return True  # the grammar engine accepted the schema; not ours to judge here
        return True


def _without_patterns(schema):
    """`schema` without the keywords that run regular expressions (pattern, patternProperties)."""
    if isinstance(schema, dict):
        return {k: _without_patterns(v) for k, v in schema.items() if k not in ("pattern", "patternProperties")}
    if isinstance(schema, list):
        return [_without_patterns(v) for v in schema]
    return schema


def _call_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object, or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters"))
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def collect(deltas) -> tuple[str | None, list[dict]]:
    """Deltas of a whole answer -> (content or None, OpenAI tool_calls)."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, Content):
            content += d.text
        elif isinstance(d, CallStart):
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        else:
            calls[d.index]["function"]["arguments"] += d.text
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls
