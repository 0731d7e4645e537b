"""A sequence from request to row: what was asked (`Request`), its state while it runs
(`Row`: committed tokens, stopping rules, streamed text) and why it ended (`FinishReason`).

`Row.append` is the only way a generated token enters a row; it applies EOS, the
token budget and stop strings identically in every mode, which is what keeps AR,
SD and SSD outputs token-for-token equal. While a row runs, its text grows by decoding
a short window of new tokens (cost independent of the length so far); the final text
is one full decode.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ssdlocal.core.choice import Choice
from ssdlocal.core.config import SamplingParams

_ids = itertools.count()


class FinishReason(Choice):
    """Why a row ended: end-of-sequence, a stop string, its token budget, a cancel, or an
    error (its grammar could not continue: `Row.error` says why). The server maps these to
    OpenAI's words at its edge."""

    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class Request:
    """One sequence of work for the engine, as asked.

    `prompt`: token ids (at least one). `params.max_new_tokens` None: the rest of the
    context. `grammar`: a grammar.compiler.Grammar the answer follows, or None.
    `exclusive`: None, or a key of requests that share a batch only with each other (a
    seeded sample: its random stream and its proposals must not depend on other requests).
    `random_key`: requests whose sampled tokens draw from one random stream share it
    (None: the stream of every request with the same sampling settings).
    """

    prompt: tuple[int, ...]
    params: SamplingParams
    grammar: object = None
    exclusive: object = None
    random_key: object = None
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def settings(self) -> tuple:
        """What verification depends on: rows with equal settings verify together."""
        stream = () if self.random_key is None or self.params.greedy else (self.random_key,)
        return (*self.params.warp, *stream)


class Decoder(Protocol):
    """What a row needs of a tokenizer: token ids -> text (a transformers tokenizer, or
    the llama.cpp backend's, has it)."""

    def decode(self, ids: Sequence[int], /, *, skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Row:
    """One sequence being generated: prompt + generated tokens. A row the engine seats for
    a request keeps it (`request`) and, while the request has a grammar, its matcher
    (`guide`, a grammar.guide.RowGuide), both carried across re-seats."""

    prompt: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    tokenizer: Decoder
    budget: int | None = None  # new tokens allowed when params.max_new_tokens is None
    generated: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the row ended with FinishReason.ERROR (its grammar could not continue)
    request: Request | None = None  # what it serves (None: a row made without one, e.g. in a test)
    # its grammar matcher while it has a grammar: a grammar.guide.RowGuide (Any: core imports no grammar)
    guide: Any = None
    _emitted_chars: int = 0
    _text: str = ""  # text of generated[:_read], grown incrementally while running
    _prefix: int = 0  # start of the decode window
    _read: int = 0  # generated tokens whose text is in _text
    _final: str | None = None  # the full decode, once finished

    @classmethod
    def serving(cls, request: Request, eos_ids: frozenset[int], tokenizer: Decoder, budget: int | None) -> Row:
        """The row of `request` (its prompt and params), with `budget` new tokens at most
        when its params set none."""
        return cls(list(request.prompt), request.params, eos_ids, tokenizer, budget, request=request)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End the row now (a cancel, an error) unless it has ended already."""
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        """len(tokens), without building the list."""
        return len(self.prompt) + len(self.generated)

    def tail(self, start: int) -> list[int]:
        """tokens[start:], building only that part."""
        cut = start - len(self.prompt)
        return self.generated[cut:] if cut >= 0 else self.prompt[start:] + self.generated

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def append(self, token: int) -> bool:
        """Add one generated token; returns False (and ignores the token) once finished."""
        if self.finish_reason is not None:
            return False
        self.generated.append(token)
        if not self.params.ignore_eos and token in self.eos_ids:
            self.finish_reason = FinishReason.EOS
        elif self.params.stop and self._stop_index(self._running_text()) is not None:
            self.finish_reason = FinishReason.STOP
        elif len(self.generated) >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return True

    @property
    def max_new_tokens(self) -> int:
        """The row's token budget: the params' cap, else its own (the rest of the context)."""
        cap = self.params.max_new_tokens
        if cap is None:
            if self.budget is None:
                raise ValueError("a row without max_new_tokens needs a budget")  # engine bug
            return self.budget
        return cap

    def full_text(self) -> str:
        return self.tokenizer.decode(self.generated, skip_special_tokens=True)

    def _running_text(self) -> str:
        """The text so far, extended by decoding only the tokens since the last call.

        Decodes the window generated[_prefix:] against generated[_prefix:_read] and keeps
        the difference, unless it ends in a partial character (U+FFFD), which waits for
        the next token. Tokens that decode to nothing (skipped specials) also wait.
        """
        if self._read < len(self.generated):
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            before = decode(self.generated[self._prefix : self._read])
            now = decode(self.generated[self._prefix :])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self._text += now[len(before) :]
                self._prefix, self._read = self._read, len(self.generated)
        return self._text

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def text(self) -> str:
        """The output text: decoded, cut before the first stop string."""
        if self.finish_reason is None:
            text = self._running_text()
        else:
            if self._final is None:
                self._final = self.full_text()
            text = self._final
        cut = self._stop_index(text) if self.params.stop else None
        return text if cut is None else text[:cut]

    def take_text_delta(self) -> str:
        """Text not yet streamed that can no longer change (held back: partial UTF-8,
        and a tail that might be the start of a stop string)."""
        text = self.text()
        if self.finish_reason is None:
            end = len(text)
            while end > self._emitted_chars and text[end - 1] == "\ufffd":
                end -= 1
            for stop in self.params.stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if text[:end].endswith(stop[:n]):
                        end -= n
                        break
            text = text[: max(end, self._emitted_chars)]
        delta = text[self._emitted_chars :]
        self._emitted_chars = len(text)
        return delta
