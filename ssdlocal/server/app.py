"""The HTTP surface (Starlette): OpenAI routes, server-sent events, errors, metrics.

GET /v1/models, POST /v1/completions and /v1/chat/completions (whole or streamed as
OpenAI chunks ending with `data: [DONE]`), GET /metrics (Prometheus text), GET /health.
Requests are parsed by protocol.py, tokenized here (a tokenizer copy of our own: the
engine thread decodes with its own), and run by the Scheduler; a client that
disconnects cancels its job. Every failure is answered with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from ssdlocal.core.errors import SSDLocalError, UsageError
from ssdlocal.engine.prompts import encode_messages
from ssdlocal.server.metrics import Metrics
from ssdlocal.server.protocol import (
    APIError,
    ParsedRequest,
    bad,
    parse_chat,
    parse_completion,
)
from ssdlocal.server.responses import Responses
from ssdlocal.server.scheduler import Chunk, Failed, Finished, Job, Scheduler

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


@dataclass
class ServerState:
    """What the routes share: the scheduler, counters and the served model's facts."""

    scheduler: Scheduler
    metrics: Metrics
    model: str  # the id clients send as "model"
    context: int  # the target's context (prompt + new tokens)
    tokenizer: object  # the target's tokenizer (copied for this side)
    api_key: str | None = None
    max_new_tokens: int | None = None  # cap on answers; None: until end-of-sequence / the context
    vocab_size: int | None = None  # token-id prompts must stay below it
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        try:
            self.tokenizer = copy.deepcopy(self.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, under the lock
            log.debug("tokenizer not copyable; sharing the engine's")
        self._tokenizer_lock = threading.Lock()

    def encode(self, req: ParsedRequest) -> list[tuple[int, ...]]:
        """Token ids per prompt (chat: one, the conversation through the template)."""
        with self._tokenizer_lock:
            if req.chat:
                return [tuple(encode_messages(self.tokenizer, req.messages))]
            return [p if isinstance(p, tuple) else tuple(self.tokenizer.encode(p)) for p in req.prompts]


def create_app(state: ServerState) -> Starlette:
    async def models(request: Request) -> Response:
        _authorize(request, state)
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    async def model(request: Request) -> Response:
        _authorize(request, state)
        if request.path_params["model"] != state.model:
            raise _unknown_model(request.path_params["model"])
        return JSONResponse(_model_card(state))

    async def completions(request: Request) -> Response:
        return await _generate(request, state, "completions", parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(request, state, "chat", parse_chat)

    async def metrics(request: Request) -> Response:
        text = state.metrics.render(state.scheduler.running, state.scheduler.waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(request: Request) -> Response:
        if not state.scheduler.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)


# ---------------------------------------------------------------------- errors
async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error")
    return JSONResponse(_failure(exc).body(), status_code=500)


def _failure(exc: BaseException) -> APIError:
    """An engine-side failure as an API error (usage errors are the client's)."""
    if isinstance(exc, UsageError):
        return bad(f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    if isinstance(exc, SSDLocalError):
        message = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        return APIError(500, message, type="server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def _unknown_model(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist: GET /v1/models lists the served model",
        param="model", code="model_not_found",
    )  # fmt: skip


def _authorize(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "Incorrect or missing API key (send Authorization: Bearer KEY)",
                       code="invalid_api_key")  # fmt: skip


def _model_card(state: ServerState) -> dict:
    return {"id": state.model, "object": "model", "created": state.created, "owned_by": "ssdlocal",
            "max_model_len": state.context}  # fmt: skip


# ---------------------------------------------------------------------- generation
async def _generate(request: Request, state: ServerState, endpoint: str, parse) -> Response:
    started = time.perf_counter()
    try:
        _authorize(request, state)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from None
        req = parse(body, state.max_new_tokens)
        if req.model != state.model:
            raise _unknown_model(req.model)
        try:
            prompts = await run_in_threadpool(state.encode, req)
        except UsageError as exc:
            raise bad(exc.message, param="messages" if req.chat else "prompt") from None
        _check_context(prompts, req, state.context)
        _check_token_ids(prompts, state.vocab_size)
    except APIError:
        state.metrics.record_request(endpoint, "invalid")
        raise
    rows = [ids for ids in prompts for _ in range(req.n)]
    job = state.scheduler.submit(rows, req.params, req.seeded, stream=req.stream)
    answer = Responses(req, state.model, sum(map(len, prompts)))
    outcome = _Outcome(state.metrics, endpoint, sum(map(len, prompts)), started)
    if req.stream:
        return StreamingResponse(
            _sse(request, job, answer, outcome), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
    try:
        async for item in _items(request, job):
            if isinstance(item, Failed):
                outcome.status = "error"
                raise _failure(item.error)
            if isinstance(item, Finished):
                outcome.status = "ok"
                return JSONResponse(answer.complete(item))
    except ClientGone:
        outcome.status = "cancelled"
        return Response(status_code=499)
    finally:
        job.cancel()  # no-op once answered
        outcome.record()
    raise AssertionError("the job ended without an answer")  # pragma: no cover


def _check_context(prompts: list[tuple[int, ...]], req: ParsedRequest, context: int) -> None:
    asked = req.params.max_new_tokens
    param = "messages" if req.chat else "prompt"
    for ids in prompts:
        if asked is None and len(ids) >= context:
            raise bad(
                f"This model's maximum context length is {context} tokens, however the prompt "
                f"has {len(ids)} tokens. Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded",
            )  # fmt: skip
        if asked is not None and len(ids) + asked > context:
            raise bad(
                f"This model's maximum context length is {context} tokens, however you requested "
                f"{len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param=param, code="context_length_exceeded",
            )  # fmt: skip


def _check_token_ids(prompts: list[tuple[int, ...]], vocab_size: int | None) -> None:
    for ids in prompts:
        bad_ids = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{(vocab_size or 1) - 1})",
                      param="prompt")  # fmt: skip


@dataclass
class _Outcome:
    """Counts one request once, however it ends."""

    metrics: Metrics
    endpoint: str
    prompt_tokens: int
    started: float
    status: str = "cancelled"

    def record(self) -> None:
        duration = time.perf_counter() - self.started
        self.metrics.record_request(self.endpoint, self.status, self.prompt_tokens, duration)


async def _items(request: Request, job: Job) -> AsyncIterator[Chunk | Finished | Failed]:
    """The job's items until its answer (Finished or Failed); ClientGone if the client
    disconnects first (the job is then cancelled)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            item_task = asyncio.ensure_future(job.queue.get())
            done, _ = await asyncio.wait({item_task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if item_task not in done:
                item_task.cancel()
                job.cancel()
                raise ClientGone
            item = item_task.result()
            yield item
            if isinstance(item, (Finished, Failed)):
                return
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(request: Request, job: Job, answer: Responses, outcome: _Outcome) -> AsyncIterator[str]:
    """Server-sent events: OpenAI chunks, then `data: [DONE]`."""
    try:
        if answer.req.chat:
            for index in range(len(job.rows)):
                yield _event(answer.role_chunk(index))
        async for item in _items(request, job):
            if isinstance(item, Chunk):
                if item.text or answer.req.return_token_ids:
                    yield _event(answer.text_chunk(item.choice, item.text, item.token_ids))
            elif isinstance(item, Finished):
                for chunk in answer.finish_chunks(item):
                    yield _event(chunk)
                outcome.status = "ok"
            else:
                outcome.status = "error"
                yield _event(_failure(item.error).body())
        yield "data: [DONE]\n\n"
    except ClientGone:
        outcome.status = "cancelled"
    finally:
        job.cancel()
        outcome.record()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
