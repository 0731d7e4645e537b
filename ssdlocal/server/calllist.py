"""A forced list of tool calls that ends when the model would loop.

The grammar of a forced answer (tools.forced_grammar_text) lets any whole call be followed
by another, up to MAX_FORCED_CALLS, and makes end-of-sequence the only choice after the last
one allowed. A model that repeats a call would write the same call again and again until
that cap or `max_tokens`, and tool_parse drops each repeat anyway. `CallList` wraps such a
compiled grammar: where its own grammar allows end-of-sequence (a whole call just ended)
and that call repeats an earlier one of the answer (tool_parse's rule: the same name and
arguments), each row's matcher allows only end-of-sequence, so the answer finishes there.

The mask is a function of the row's tokens alone (they are decoded and read by the same
ToolCallParser the answer goes through), so every mode verifies drafts under the same
masks and greedy SD and SSD still equal AR; rollbacks of rejected drafts drop the tokens
with the matcher's own. Masks are computed on the engine's thread, which owns the
tokenizer this decodes with. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from ssdlocal.server.structured import Tool
from ssdlocal.server.tool_parse import ToolCallParser
from ssdlocal.server.tools import ToolFormat


class CallList:
    """A compiled forced-call grammar (grammar.compiler.Grammar) that ends a repeating
    list; everything else (its key, kind, `failed`) is the wrapped grammar's."""

    def __init__(self, grammar, fmt: ToolFormat, tools: Sequence[Tool], decoder, eos_ids) -> None:
        self.grammar = grammar
        self.fmt = fmt
        self.names = [t.name for t in tools]
        self.schemas = {t.name: t.parameters for t in tools}
        self.decoder = decoder  # a tokenizer: ids -> text, as the engine decodes answers
        self.eos_ids = tuple(eos_ids)

    @property
    def failed(self) -> str | None:
        return self.grammar.failed

    @failed.setter
    def failed(self, message: str | None) -> None:
        self.grammar.failed = message  # the compiled grammar's lexer is spent: refused hereafter

    def __getattr__(self, name: str):  # only for what the class lacks: key, kind, compile_s
        if name == "grammar":
            raise AttributeError(name)
        return getattr(self.grammar, name)

    def matcher(self) -> _CallListMatcher:
        return _CallListMatcher(self.grammar.matcher(), self)

    def repeats(self, tokens: Sequence[int]) -> bool:
        """Whether the answer so far (`tokens`) ends its calls with a repeat of an earlier one."""
        parser = ToolCallParser(self.fmt, self.names, self.schemas)
        parser.feed(self.decoder.decode(list(tokens), skip_special_tokens=True))
        parser.finish()
        return parser.repeated

    def __repr__(self) -> str:
        return f"CallList({self.grammar!r})"


class _CallListMatcher:
    """One row's llguidance matcher with the tokens it consumed; the mask at a whole call
    that repeats an earlier one allows only end-of-sequence. The rest is llguidance's."""

    def __init__(self, inner, calls: CallList) -> None:
        self._inner = inner
        self._calls = calls
        self._tokens: list[int] = []

    def consume_token(self, token: int) -> bool:
        ok = self._inner.consume_token(token)
        if ok:
            self._tokens.append(token)
        return ok

    def rollback(self, n: int) -> None:
        self._inner.rollback(n)
        if n:
            del self._tokens[-n:]

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        if not (self._inner.is_accepting() and self._calls.repeats(self._tokens)):
            self._inner.unsafe_compute_mask_ptr(ptr, size)
            return
        words = (ctypes.c_uint32 * (size // 4)).from_address(ptr)
        ctypes.memset(ptr, 0, size)
        for token in self._calls.eos_ids:
            if token >> 5 < len(words):
                words[token >> 5] |= 1 << (token & 31)

    def __getattr__(self, name: str):  # is_stopped, is_error, get_error, is_accepting, ...
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)
