"""OpenAI response bodies: completions and chat completions, whole or as stream chunks.

Every whole answer carries `usage` and, under `ssdlocal`, the request's own speculation
stats (acceptance_rate, mean_accepted_len, cache_hit_rate, tokens_per_s, mode, ...). A
stream sends the stats with its last finish chunk and `usage` as OpenAI does: only when
`stream_options.include_usage` asks for it, and only on one final chunk with no choices
(clients that add up usage across chunks count it once). A chat answer to a request with tools is read by
tool_parse.py: calls become `message.tool_calls` (streamed as `delta.tool_calls` with their
index, each call once complete) and the finish reason `tool_calls`. A choice whose grammar
the engine could not continue ends with finish_reason "error" and an `error` (`failures`). Log-probabilities go
with the tokens they belong to (logprob_format.py), never for the end-of-sequence token
that ended a choice (`answer_logprobs`). Pure dict building: no HTTP, no engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ssdlocal.core.sequence import FinishReason
from ssdlocal.server.logprob_format import TokenText, chat_entries, completion_block
from ssdlocal.server.protocol import APIError, ParsedRequest
from ssdlocal.server.scheduler import Chunk, Finished
from ssdlocal.server.tool_parse import CallStart, Content, ToolCallParser, collect

# our finish reasons in OpenAI's words (a cancelled row's answer is never sent)
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ERROR: "error",
}


def answer_logprobs(logprobs, token_ids, reason: FinishReason | None):
    """A row's logprobs without the end-of-sequence token that ended it (Qwen's
    `<|im_end|>`): it is no part of the answer's text, and OpenAI never returns it, so
    the tokens returned join to the text."""
    if logprobs and reason is FinishReason.EOS and token_ids and logprobs[-1].token == token_ids[-1]:
        return logprobs[:-1]
    return logprobs


def grammar_failure(req: ParsedRequest, message: str, choice: int | None = None) -> APIError:
    """A choice whose grammar the engine could not continue (finish_reason "error"), as
    OpenAI's error body naming the field that asked for the grammar."""
    param = "tool_choice" if req.tool_choice.forced else "response_format" if req.response_format else "tools"
    where = f"choice {choice}: " if choice is not None and req.n > 1 else ""
    return APIError(400, f"{where}{message} (simplify the schema or pattern)", param=param, code="grammar_failed")


def finish_reason(
    reason: FinishReason | None, called: bool = False, parser: ToolCallParser | None = None
) -> str | None:
    """OpenAI's finish reason; an answer that ended by itself after tool calls, or whose
    list of calls ended with a repeated call: tool_calls. An answer that ended inside a
    call (a stop string, max_tokens) keeps its own reason: the cut call is text."""
    if parser is not None:
        if parser.repeated and parser.calls and reason is not FinishReason.ERROR:
            return "tool_calls"
        called = parser.calls > 0 and not parser.cut
    if called and reason in (FinishReason.EOS, FinishReason.STOP):
        return "tool_calls"
    return None if reason is None else FINISH_REASONS.get(reason, reason.value)


class Responses:
    """Builds the bodies of one request's answer (one id and timestamp for all chunks).

    `tool_format`: the format the request's tools were offered in (None: no tools, the
    answer is text); `tokenizer`: for log-probabilities' token texts."""

    def __init__(self, req: ParsedRequest, model: str, prompt_tokens: int, *, tool_format=None, tokenizer=None) -> None:
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tool_format = tool_format if req.chat else None
        self.text_of = TokenText(tokenizer) if tokenizer is not None else None
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, while streaming
        self._pending: dict[int, list] = {}  # per choice: logprobs not yet sent
        self._offsets: dict[int, int] = {}  # per choice: completion characters so far (text_offset)

    @property
    def object(self) -> str:
        return "chat.completion" if self.req.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage(self, finished: Finished) -> dict[str, Any]:
        """OpenAI's usage: prompt tokens counted once per prompt (not per choice), of which
        `prompt_tokens_details.cached_tokens` came from the prefix cache."""
        completion_tokens = sum(len(ids) for _, ids, _ in finished.choices)
        cached = sum(finished.cached[:: max(self.req.n, 1)])  # the first choice of each prompt
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _parser(self) -> ToolCallParser:
        return ToolCallParser(
            self.tool_format, [t.name for t in self.req.tools], {t.name: t.parameters for t in self.req.tools}
        )

    def _logprobs(self, index: int, logprobs) -> dict[str, Any] | None:
        if logprobs is None or self.text_of is None:
            return None
        if self.req.chat:
            return {"content": chat_entries(logprobs, self.text_of), "refusal": None}
        block = completion_block(logprobs, self.text_of, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in block["tokens"])
        return block

    # ------------------------------------------------------------------ whole answer
    def complete(self, finished: Finished) -> dict[str, Any]:
        choices = []
        for index, (text, ids, reason) in enumerate(finished.choices):
            lps = answer_logprobs(finished.logprobs[index], ids, reason) if finished.logprobs is not None else None
            parser = None
            if self.req.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tool_format is not None:
                    parser = self._parser()
                    content, calls = collect(parser.feed(text) + parser.finish())
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text}
            choice.update(
                {"logprobs": self._logprobs(index, lps), "finish_reason": finish_reason(reason, parser=parser)}
            )
            error = finished.errors[index] if index < len(finished.errors) else None
            if error is not None:
                choice["error"] = grammar_failure(self.req, error).body()["error"]
            if self.req.return_token_ids:
                choice["token_ids"] = list(ids)
            choices.append(choice)
        body = self._envelope(self.object, choices)
        body["usage"] = self.usage(finished)
        body["ssdlocal"] = finished.stats
        return body

    # ------------------------------------------------------------------ stream
    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return self._envelope(obj, [choice])

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role."""
        return self._chunk(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def text_chunk(self, index: int, text: str, token_ids: tuple[int, ...], logprobs=None) -> dict[str, Any]:
        if self.req.chat:
            choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
        else:
            choice = {"index": index, "text": text}
        choice.update({"logprobs": self._logprobs(index, logprobs), "finish_reason": None})
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._chunk(choice)

    def stream_chunks(self, item: Chunk) -> list[dict[str, Any]]:
        """The chunks for one engine Chunk: its text (or tool-call pieces) and logprobs.
        Logprobs of tokens whose text is still held back go with the next chunk sent."""
        pending = self._pending.setdefault(item.choice, [])
        if item.logprobs:
            pending.extend(answer_logprobs(item.logprobs, item.token_ids, item.finish_reason))
        if self.tool_format is None:
            if not (item.text or self.req.return_token_ids):
                return []  # text held back (a partial character, a stop string's start)
            lps, self._pending[item.choice] = pending or None, []
            return [self.text_chunk(item.choice, item.text, item.token_ids, lps)]
        parser = self._parsers.setdefault(item.choice, self._parser())
        return self._delta_chunks(item.choice, parser.feed(item.text))

    def _delta_chunks(self, index: int, deltas) -> list[dict[str, Any]]:
        chunks = []
        for d in deltas:
            if isinstance(d, Content):
                delta: dict[str, Any] = {"content": d.text}
            elif isinstance(d, CallStart):
                delta = {
                    "tool_calls": [
                        {
                            "index": d.index,
                            "id": d.id,
                            "type": "function",
                            "function": {"name": d.name, "arguments": ""},
                        }
                    ]
                }
            else:
                delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
            chunks.append(self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}))
        if chunks and self._pending.get(index):
            chunks[0]["choices"][0]["logprobs"] = self._logprobs(index, self._pending[index])
            self._pending[index] = []
        return chunks

    def failures(self, finished: Finished) -> list[APIError]:
        """The choices that ended with finish_reason "error", as errors (a stream sends
        each as an error event after the closing chunks)."""
        return [grammar_failure(self.req, e, i) for i, e in enumerate(finished.errors) if e is not None]

    def finish_chunks(self, finished: Finished) -> list[dict[str, Any]]:
        """Held-back pieces, then one closing chunk per choice; the last carries the stats
        (never usage). With stream_options.include_usage, OpenAI's usage chunk follows:
        `choices: []` and the request's usage, the only chunk that carries it."""
        chunks = []
        for index, (_, _, reason) in enumerate(finished.choices):
            parser = None
            if self.tool_format is not None:
                parser = self._parsers.setdefault(index, self._parser())
                chunks += self._delta_chunks(index, parser.finish())
            choice: dict[str, Any] = {"index": index}
            if self.req.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            rest = self._pending.pop(index, None)
            choice.update(
                {
                    "logprobs": self._logprobs(index, rest) if rest else None,
                    "finish_reason": finish_reason(reason, parser=parser),
                }
            )
            if self.req.return_token_ids:
                choice["token_ids"] = []
            chunks.append(self._chunk(choice))
        chunks[-1]["ssdlocal"] = finished.stats
        if self.req.include_usage:
            last = self._envelope(chunks[-1]["object"], [])
            last["usage"] = self.usage(finished)
            chunks.append(last)
        return chunks
