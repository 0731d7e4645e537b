"""OpenAI response bodies: completions and chat completions, whole or as stream chunks.

Every answer carries `usage` and, under `ssdlocal`, the request's own speculation stats
(acceptance_rate, mean_accepted_len, cache_hit_rate, tokens_per_s, mode, ...); a stream
sends them with its final chunk. Pure dict building: no HTTP, no engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ssdlocal.server.protocol import ParsedRequest
from ssdlocal.server.scheduler import Finished

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


class Responses:
    """Builds the bodies of one request's answer (one id and timestamp for all chunks)."""

    def __init__(self, req: ParsedRequest, model: str, prompt_tokens: int) -> None:
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

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

    # ------------------------------------------------------------------ whole answer
    def complete(self, finished: Finished) -> dict[str, Any]:
        choices = []
        for index, (text, ids, reason) in enumerate(finished.choices):
            if self.req.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice.update({"logprobs": None, "finish_reason": finish_reason(reason)})
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

    def text_chunk(self, index: int, text: str, token_ids: tuple[int, ...]) -> dict[str, Any]:
        if self.req.chat:
            choice: dict[str, Any] = {"index": index, "delta": {"content": text}}
        else:
            choice = {"index": index, "text": text}
        choice.update({"logprobs": None, "finish_reason": None})
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._chunk(choice)

    def finish_chunks(self, finished: Finished) -> list[dict[str, Any]]:
        """One closing chunk per choice; the last carries usage and the stats. With
        stream_options.include_usage, OpenAI's extra usage chunk (no choices) follows."""
        chunks = []
        for index, (_, _, reason) in enumerate(finished.choices):
            choice: dict[str, Any] = {"index": index}
            if self.req.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            choice.update({"logprobs": None, "finish_reason": finish_reason(reason)})
            if self.req.return_token_ids:
                choice["token_ids"] = []
            chunks.append(self._chunk(choice))
        usage = self.usage(finished)
        chunks[-1]["usage"] = usage
        chunks[-1]["ssdlocal"] = finished.stats
        if self.req.include_usage:
            last = self._envelope(chunks[-1]["object"], [])
            last["usage"] = usage
            chunks.append(last)
        return chunks
