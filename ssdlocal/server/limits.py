"""What one client may ask of the server, and the checks that hold requests to it.

`ServerLimits` (the `serve` options: body size, prompt characters, rows per request,
connections, header / body / idle timeouts); `read_body` reads a request body within
its size and time limits (413 / 408, 503 once the server is stopping); `check_request`
bounds a parsed request before anything costly (tokenizing) runs. The bounds of stop
strings live in protocol.py with the other fields. Knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass

from ssdlocal.core.errors import UsageError
from ssdlocal.server.protocol import APIError, ParsedRequest, bad

MiB = 1 << 20
CHARS_PER_TOKEN = 32  # default prompt-character limit per token of context ...
MAX_DEFAULT_PROMPT_CHARS = 1_000_000  # ... up to this many characters


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on requests and connections (docs/hardening.md, "Limits")."""

    max_body_bytes: int = 8 * MiB  # larger bodies: 413, unread
    max_prompt_chars: int | None = None  # per request; None: CHARS_PER_TOKEN x context (capped)
    max_request_rows: int = 64  # prompts x n; run in engine batches of at most --max-batch
    max_connections: int = 128  # one more is answered 503 and closed
    header_timeout_s: float = 10.0  # a request's head, from connecting or the previous answer
    body_timeout_s: float = 30.0  # a request's body, once its head arrived
    idle_timeout_s: float = 5.0  # a kept-alive connection between requests

    def __post_init__(self) -> None:
        for name, value, example in (
            ("max-body-mb", self.max_body_bytes, "--max-body-mb 8"),
            ("max-request-rows", self.max_request_rows, "--max-request-rows 64"),
            ("max-connections", self.max_connections, "--max-connections 128"),
        ):
            if value < 1:
                raise UsageError(f"{name} must be positive, got {value}", f"use e.g. {example}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise UsageError(
                f"max-prompt-chars must be >= 1, got {self.max_prompt_chars}",
                "drop --max-prompt-chars for the default (32 per token of context)",
            )
        for name, value in (
            ("header-timeout", self.header_timeout_s),
            ("body-timeout", self.body_timeout_s),
            ("idle-timeout", self.idle_timeout_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise UsageError(f"{name} must be a positive number of seconds, got {value}", f"use e.g. --{name} 10")

    def prompt_chars(self, context: int) -> int:
        """The prompt-character limit for a model with this context (tokens)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return min(CHARS_PER_TOKEN * context, MAX_DEFAULT_PROMPT_CHARS)


# ---------------------------------------------------------------------- body
def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


async def read_body(request, limits: ServerLimits, closing: asyncio.Event) -> bytes:
    """The request body, or APIError: 413 past `max_body_bytes` (a declared length is
    refused before anything is read), 408 when it does not arrive within
    `body_timeout_s`, 503 when the server starts stopping meanwhile. ClientGone if the
    client leaves."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(int(declared), limits)
    read = asyncio.ensure_future(_read(request, limits))
    stop = asyncio.ensure_future(closing.wait())
    try:
        done, _ = await asyncio.wait({read, stop}, timeout=limits.body_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if read in done:
            return read.result()
        if stop in done:
            raise shutting_down()
        raise APIError(
            408,
            f"the request body did not arrive within {limits.body_timeout_s:g} s (--body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        )
    finally:
        for task in (read, stop):
            task.cancel()


async def _read(request, limits: ServerLimits) -> bytes:
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(None, limits)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def _too_large(size: int | None, limits: ServerLimits) -> APIError:
    """413; `size` None: a body sent without a length that grew past the limit."""
    has = f"{size:,} bytes" if size is not None else f"more than {limits.max_body_bytes:,} bytes"
    return APIError(
        413,
        f"the request body has {has}, over this server's limit of {limits.max_body_bytes:,} (--max-body-mb)",
        code="request_too_large",
    )


# ---------------------------------------------------------------------- request bounds
def check_request(req: ParsedRequest, limits: ServerLimits, context: int) -> None:
    """Bounds that need no tokenizer: rows (prompts x n), the characters of everything the
    request renders (`rendered_chars`: messages, earlier calls, tool results, tools,
    schemas), and for chat the number of messages (each costs at least one token of the
    context)."""
    rows = len(req.prompts or (req.messages,)) * req.n
    if rows > limits.max_request_rows:
        what = f"{len(req.prompts)} prompts x n={req.n}" if req.prompts else f"n={req.n}"
        raise bad(
            f"this request asks for {rows} completions ({what}); this server answers at most "
            f"{limits.max_request_rows} per request (--max-request-rows)",
            param="n" if req.n > 1 else "prompt",
        )
    param = "messages" if req.chat else "prompt"
    if req.chat and len(req.messages) > context:
        raise bad(
            f"{len(req.messages)} messages cannot fit this model's context of {context} tokens",
            param=param,
            code="context_length_exceeded",
        )
    chars, limit = rendered_chars(req), limits.prompt_chars(context)
    if chars > limit:
        what = "prompt" if not req.chat else "messages, tools and schemas" if req.tools else "messages"
        raise bad(
            f"this request has {chars:,} characters to render ({what}), over this server's limit of {limit:,} "
            f"(--max-prompt-chars; the model's context is {context} tokens)",
            param=param,
            code="context_length_exceeded",
        )


def rendered_chars(req: ParsedRequest) -> int:
    """Characters of everything the request makes the server render, tokenize or compile:
    prompts; for chat every message's text, its earlier calls (names, arguments, ids) and
    a tool result's id and name, the tools (names, descriptions, parameter schemas) and
    the response format's schema. Counted on the parsed request, before any of it is
    rendered (JSON values by their compact text)."""
    if not req.chat:
        return sum(len(p) for p in req.prompts if isinstance(p, str))
    total = 0
    for m in req.messages:
        total += len(m["content"]) + len(m.get("tool_call_id", "")) + len(m.get("name", ""))
        for call in m.get("tool_calls") or ():
            function = call["function"]
            total += len(call["id"]) + len(function["name"]) + len(function["arguments"])
    for tool in req.tools:
        total += len(tool.name) + len(tool.description or "") + _json_chars(tool.parameters)
    if req.response_format is not None and req.response_format.schema is not None:
        total += _json_chars(req.response_format.schema)
    return total


def _json_chars(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
