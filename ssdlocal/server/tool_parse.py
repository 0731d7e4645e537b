"""Tool calls read out of a model's answer, as it streams or whole: one parser for both.

`ToolCallParser(fmt, names)` takes the answer's text in pieces (`feed`) and at its end
(`finish`) and returns what to send: content text, the start of a call (id and name, once
the name is written and is one of the tools) and the call's arguments in pieces, as they
arrive. A whole answer is the same pieces joined, so a stream and a whole answer always
agree. Text that looks like a call but is not one in the format (no tags for a Hermes
model, a name that is not a tool, JSON that does not parse before the name is known) stays
content. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

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
    text: str  # the next piece of the arguments' JSON text


Delta = Content | CallStart | CallArgs


@dataclass
class _Call:
    """The call being read: its text after the opening tag (or from its '{')."""

    text: str = ""
    started: bool = False  # CallStart sent
    args_from: int = -1  # where the arguments' value starts in `text` (once started)
    args_sent: int = 0  # characters of the arguments sent
    args_done: bool = False
    scan: "_Scanner" = field(default_factory=lambda: _Scanner())


class _Scanner:
    """Where a JSON value ends: depth of brackets outside strings, char by char."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.seen = False  # the value has begun
        self.done = False
        self.pos = 0  # characters consumed

    def feed(self, text: str, start: int = 0) -> None:
        """Scan text[start:] (continuing from self.pos) until the value ends."""
        i = max(start, self.pos)
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
                self.seen = True
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    self.done = self.depth <= 0
                elif self.depth == 0 and ch in ",":
                    self.done = True
                    i -= 1
        self.pos = i


_HEADER = r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(%s)"\s*:\s*'


class ToolCallParser:
    """Incremental reader of one answer in format `fmt`, for the tools named `names`."""

    def __init__(self, fmt: ToolFormat, names) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.calls = 0  # calls started
        self._pending = ""  # text not yet classified
        self._call: _Call | None = None
        self._decided = fmt.open_tag is not None  # untagged formats: is the answer a call at all?
        keys = "|".join(sorted({fmt.args_key, "arguments", "parameters"}))
        self._header = re.compile(_HEADER % keys, re.DOTALL)

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        out = self._advance(final=True)
        if self._call is not None:
            out += self._close(final=True)
        if self._pending:
            out.append(Content(self._pending))
            self._pending = ""
        return out

    # ------------------------------------------------------------------ states
    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._call is not None:
                if not self._in_call(out, final):
                    return out
            elif not self._in_text(out, final):
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
                    self._call = _Call()
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
            self._pending = self._pending[at + len(tag):]
            self._call = _Call()
            return True
        keep = 0 if final else _partial_suffix(self._pending, tag)
        text = self._pending[: len(self._pending) - keep]
        if text and (text.strip() or not self.calls):
            out.append(Content(text))
        self._pending = self._pending[len(text):]
        return False

    def _in_call(self, out: list[Delta], final: bool) -> bool:
        """Inside a call; True when it ended (the loop goes on with the rest)."""
        call, close = self._call, self.fmt.close_tag
        call.text += self._pending
        self._pending = ""
        end = call.text.find(close) if close is not None else -1
        body = call.text if end < 0 else call.text[:end]
        self._start(call, body, out)
        if close is None:  # untagged: the call ends where its object does
            whole = _Scanner()
            whole.feed(body)
            if whole.done:
                self._pending = body[whole.pos:]
                call.text = body[: whole.pos]
                out += self._close(final=False)
                return True
            return False
        if end < 0:
            keep = _partial_suffix(call.text, close)
            self._send_args(call, call.text[: len(call.text) - keep], out)
            return False
        self._pending = call.text[end + len(close):]
        call.text = body
        out += self._close(final=False)
        return True

    def _start(self, call: _Call, body: str, out: list[Delta]) -> None:
        if call.started:
            return
        match = self._header.match(body)
        if match is None:
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return
        if name not in self.names:
            return
        call.started = True
        call.args_from = match.end()
        out.append(CallStart(self.calls, "call_" + uuid.uuid4().hex[:24], name))
        self.calls += 1

    def _send_args(self, call: _Call, body: str, out: list[Delta]) -> None:
        """Send the arguments' characters that have arrived, up to where their value ends."""
        if not call.started or call.args_done:
            return
        call.scan.feed(body, call.args_from)
        end = call.scan.pos
        piece = body[call.args_from + call.args_sent : end]
        if call.args_sent == 0:
            piece = piece.lstrip()
            call.args_from += len(body[call.args_from : end]) - len(piece) - call.args_sent
        if piece:
            out.append(CallArgs(self.calls - 1, piece))
            call.args_sent += len(piece)
        call.args_done = call.scan.done

    def _close(self, final: bool) -> list[Delta]:
        """The call's text is complete (or the answer ended inside it)."""
        call, self._call = self._call, None
        out: list[Delta] = []
        if call.started:
            self._send_args(call, call.text, out)
            return out
        parsed = _call_object(call.text)  # the name may have come after the arguments
        if parsed is not None and parsed[0] in self.names:
            index = self.calls
            self.calls += 1
            return [CallStart(index, "call_" + uuid.uuid4().hex[:24], parsed[0]), CallArgs(index, parsed[1])]
        tag_open = self.fmt.open_tag or ""
        tag_close = self.fmt.close_tag if (self.fmt.close_tag and not final) else ""
        return [Content(tag_open + call.text + tag_close)]


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
