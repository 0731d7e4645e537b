"""The HTTP surface (Starlette): OpenAI routes, server-sent events, errors, metrics.

GET /v1/models, POST /v1/completions and /v1/chat/completions (whole or streamed as
OpenAI chunks ending with `data: [DONE]`), POST /infill (llama.cpp's fill-in-the-middle,
infill.py; a completion with `suffix` is one too), GET /metrics (Prometheus text), GET /health.
Requests are read and bounded by limits.py, parsed by protocol.py, tokenized here (a
tokenizer copy of our own, one prompt at a time under its lock: the engine thread
decodes with its own), and run by the Scheduler; a client that disconnects cancels its
job. When the server stops, answers in flight end with a "server shutting down" error.
Every failure is answered with OpenAI's error body; a client's mistakes are 4xx.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ssdlocal.core.errors import SSDLocalError, UsageError
from ssdlocal.engine.fim import fim_tokens
from ssdlocal.engine.prompts import encode_messages
from ssdlocal.server.gate import AccessPolicy, guard
from ssdlocal.server.grammars import RequestGrammars
from ssdlocal.server.infill import InfillAnswer, check_fim_chars, fim_ids, parse_infill
from ssdlocal.server.limits import ClientGone, ServerLimits, check_request, read_body, shutting_down
from ssdlocal.server.metrics import ServerMetrics
from ssdlocal.server.protocol import (
    RETRY_AFTER_S,
    APIError,
    ParsedRequest,
    bad,
    parse_chat,
    parse_completion,
)
from ssdlocal.server.responses import Responses
from ssdlocal.server.scheduler import Chunk, Failed, Finished, Job, Scheduler, ServerShuttingDown
from ssdlocal.server.tools import template_messages

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share: the scheduler, counters and the served model's facts."""

    scheduler: Scheduler
    metrics: ServerMetrics
    model: str  # the id clients send as "model"
    context: int  # the target's context (prompt + new tokens)
    tokenizer: object  # the target's tokenizer (copied for this side)
    api_key: str | None = None
    max_new_tokens: int | None = None  # cap on answers; None: until end-of-sequence / the context
    vocab_size: int | None = None  # token-id prompts must stay below it
    limits: ServerLimits = field(default_factory=ServerLimits)
    access: AccessPolicy = field(default_factory=AccessPolicy)  # Host / Origin allow-lists (gate.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        try:
            self.tokenizer = copy.deepcopy(self.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, under the lock
            log.debug("tokenizer not copyable; sharing the engine's")
        self._tokenizer_lock = threading.Lock()
        self.closing = asyncio.Event()  # set when the server starts stopping (begin_shutdown)
        eos = getattr(self.scheduler.engine, "eos_ids", None) or ()
        decoder = getattr(self.scheduler.engine, "tokenizer", None)  # the engine thread's, where masks are made
        self.grammars = RequestGrammars(self.tokenizer, self.vocab_size or len(self.tokenizer), eos, decoder=decoder)
        self.grammars.warm_up()
        self.fim = fim_tokens(self.tokenizer)  # the model's fill-in-the-middle tokens, or None

    def begin_shutdown(self) -> None:
        """The server is stopping: refuse new work, end answers in flight with an error."""
        self.closing.set()
        if self.grammars.pool is not None:
            self.grammars.pool.close()

    def encode(self, req: ParsedRequest) -> list[tuple[int, ...]]:
        """Token ids per prompt (chat: one, the conversation through the template). The lock
        is held for one prompt at a time, and prompts are bounded (limits.check_request)."""
        if req.chat:
            fmt = self.grammars.tools_format(req)
            tools = [t.as_template() for t in req.tools] if fmt is not None else None
            messages = template_messages(req.messages)
            with self._tokenizer_lock:
                return [tuple(encode_messages(self.tokenizer, messages, tools))]
        out = []
        for p in req.prompts:
            if isinstance(p, tuple):
                out.append(p)
                continue
            with self._tokenizer_lock:
                if req.suffix is not None:  # fill-in-the-middle: the model's own FIM prompt
                    param = "input_suffix" if req.repo_level else "suffix"
                    out.append(tuple(fim_ids(self.tokenizer, self.fim, req, p, param)))
                else:
                    out.append(tuple(self.tokenizer.encode(p)))
        return out


def create_app(state: ServerState) -> Callable[..., Awaitable[None]]:
    """The ASGI app: Starlette's routes behind the gate (head size, Host, Origin, JSON
    content type: gate.py), in a wrapper that keeps cancellations at shutdown (a
    response that could not end in time) out of the log."""

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

    async def infill(request: Request) -> Response:
        return await _generate(request, state, "infill", lambda body, cap: parse_infill(body, cap, state.model))

    async def metrics(request: Request) -> Response:
        text = state.metrics.render(state.scheduler.running, state.scheduler.waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(request: Request) -> Response:
        if not state.scheduler.alive:
            return JSONResponse(
                {"status": "engine stopped"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)

    async def guarded(scope, receive, send) -> None:
        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            if not state.closing.is_set():
                raise
            # cancelled by the server's shutdown deadline (a client that stopped reading):
            # the connection is closed either way; no traceback for it

    return guard(guarded, state.access)


# ---------------------------------------------------------------------- errors
async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    err = APIError(500, "internal server error (the server's log has the details)", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def _failure(exc: BaseException) -> APIError:
    """An engine-side failure as an API error (usage errors are the client's)."""
    if isinstance(exc, ServerShuttingDown):
        return shutting_down()
    if isinstance(exc, UsageError):
        return bad(f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    if isinstance(exc, SSDLocalError):
        message = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        return APIError(500, message, type="server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def _unknown_model(name: str) -> APIError:
    name = name if len(name) <= 80 else name[:77] + "..."
    return APIError(
        404,
        f"The model `{name}` does not exist: GET /v1/models lists the served model",
        param="model",
        code="model_not_found",
    )


def _authorize(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "Incorrect or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model,
        "object": "model",
        "created": state.created,
        "owned_by": "ssdlocal",
        "max_model_len": state.context,
    }


# ---------------------------------------------------------------------- generation
class _Stopping(Exception):
    """The server started stopping while the answer was being made."""


async def _generate(request: Request, state: ServerState, endpoint: str, parse) -> Response:
    started = time.perf_counter()
    try:
        _authorize(request, state)
        if state.closing.is_set():
            raise shutting_down()
        raw = await read_body(request, state.limits, state.closing)
        req = await run_in_threadpool(_parse_body, raw, parse, state.max_new_tokens)
        if req.model != state.model:
            raise _unknown_model(req.model)
        check_request(req, state.limits, state.context)  # before the tokenizer: cheap bounds
        check_fim_chars(req, state.limits.prompt_chars(state.context))  # the suffix and context files too
        grammar = await run_in_threadpool(state.grammars.for_request, req)  # cached; bounded in time
        prompts = await run_in_threadpool(_encode, state, req)
        budgets = _budgets(prompts, req, state.context)
        _check_token_ids(prompts, state.vocab_size)
    except ClientGone:
        state.metrics.record_request(endpoint, "cancelled")
        return Response(status_code=499)
    except APIError as exc:
        state.metrics.record_request(endpoint, "invalid" if exc.status < 500 else "error")
        raise
    rows = [ids for ids in prompts for _ in range(req.n)]
    row_budgets = [b for b in budgets for _ in range(req.n)]
    job = state.scheduler.submit(rows, req.params, req.seeded, stream=req.stream, budgets=row_budgets, grammar=grammar)
    if endpoint == "infill":  # llama.cpp's answer shape
        answer = InfillAnswer(req, state.model, len(prompts[0]), context=state.context)
    else:
        answer = Responses(
            req,
            state.model,
            sum(map(len, prompts)),
            tool_format=state.grammars.tools_format(req),
            tokenizer=state.tokenizer,
        )
    outcome = _Outcome(state.metrics, endpoint, sum(map(len, prompts)), started)
    if req.stream:
        return StreamingResponse(
            _sse(request, job, answer, outcome, state.closing),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        async for item in _items(request, job, state.closing):
            if isinstance(item, Failed):
                outcome.status = "error"
                raise _failure(item.error)
            if isinstance(item, Finished):
                failures = answer.failures(item)
                if failures and len(failures) == len(item.choices):  # nothing to answer but the failure
                    outcome.status = "invalid"
                    raise failures[0]
                outcome.status = "ok"
                return JSONResponse(answer.complete(item))
    except ClientGone:
        outcome.status = "cancelled"
        return Response(status_code=499)
    except _Stopping:
        outcome.status = "error"
        raise shutting_down() from None
    finally:
        job.cancel()  # no-op once answered
        outcome.record()
    raise AssertionError("the job ended without an answer")  # pragma: no cover


def _parse_body(raw: bytes, parse, max_new_tokens: int | None) -> ParsedRequest:
    """JSON -> a validated request (in a worker thread: a large body does not stall the loop)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    return parse(body, max_new_tokens)


def _encode(state: ServerState, req: ParsedRequest) -> list[tuple[int, ...]]:
    param = "messages" if req.chat else "prompt"
    try:
        return state.encode(req)
    except UsageError as exc:
        raise bad(exc.message, param=param) from None
    except Exception as exc:
        if req.chat and _is_template_error(exc):  # e.g. "roles must alternate user/assistant"
            raise bad(f"the model's chat template refused the messages: {str(exc)[:200]}", param=param) from None
        raise


def _is_template_error(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:
        return False
    return isinstance(exc, TemplateError)


def _budgets(prompts: list[tuple[int, ...]], req: ParsedRequest, context: int) -> list[int | None]:
    """New tokens per prompt: the request's max_tokens (within --max-new-tokens) must fit
    the context; without it, min(--max-new-tokens, the room left in the context), where
    None stands for the room left (the engine's own per-row budget)."""
    param = "messages" if req.chat else "prompt"
    cap = req.params.max_new_tokens  # max_tokens within the server's cap, or the cap, or None
    budgets = []
    for ids in prompts:
        if not ids:
            raise bad("the prompt encodes to no tokens", param=param)
        room = context - len(ids)
        if req.max_tokens is not None and cap is not None and cap > room:
            raise bad(
                f"This model's maximum context length is {context} tokens, however you requested "
                f"{len(ids) + cap} tokens ({len(ids)} in the prompt, {cap} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )
        if room < 1:
            raise bad(
                f"This model's maximum context length is {context} tokens, however the prompt "
                f"has {len(ids)} tokens. Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        budgets.append(cap if req.max_tokens is not None or (cap is not None and cap < room) else None)
    return budgets


def _check_token_ids(prompts: list[tuple[int, ...]], vocab_size: int | None) -> None:
    for ids in prompts:
        bad_ids = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is outside the vocabulary (0..{(vocab_size or 1) - 1})", param="prompt")


@dataclass
class _Outcome:
    """Counts one request once, however it ends."""

    metrics: ServerMetrics
    endpoint: str
    prompt_tokens: int
    started: float
    status: str = "cancelled"

    def record(self) -> None:
        duration = time.perf_counter() - self.started
        self.metrics.record_request(self.endpoint, self.status, self.prompt_tokens, duration)


async def _items(request: Request, job: Job, closing: asyncio.Event) -> AsyncIterator[Chunk | Finished | Failed]:
    """The job's items until its answer (Finished or Failed); ClientGone if the client
    disconnects first, _Stopping if the server starts stopping (the job is then cancelled)."""
    gone = asyncio.ensure_future(_disconnected(request))
    stop = asyncio.ensure_future(closing.wait())
    try:
        while True:
            item_task = asyncio.ensure_future(job.queue.get())
            done, _ = await asyncio.wait({item_task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
            if item_task not in done:
                item_task.cancel()
                job.cancel()
                raise ClientGone if gone in done else _Stopping
            item = item_task.result()
            yield item
            if isinstance(item, (Finished, Failed)):
                return
    finally:
        gone.cancel()
        stop.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    request: Request, job: Job, answer: Responses, outcome: _Outcome, closing: asyncio.Event
) -> AsyncIterator[str]:
    """Server-sent events: OpenAI chunks, then `data: [DONE]` (llama.cpp's /infill events
    end with the one marked `"stop": true`, no `[DONE]`). A failure, or the server
    stopping, sends an error event before the end (the official client raises it)."""
    try:
        if answer.req.chat:
            for index in range(len(job.rows)):
                yield _event(answer.role_chunk(index))
        try:
            async for item in _items(request, job, closing):
                if isinstance(item, Chunk):
                    for chunk in answer.stream_chunks(item):
                        yield _event(chunk)
                elif isinstance(item, Finished):
                    for chunk in answer.finish_chunks(item):
                        yield _event(chunk)
                    failures = answer.failures(item)
                    for failure in failures:  # after every choice's closing chunk: the others are whole
                        yield _event(failure.body())
                    outcome.status = "invalid" if failures and len(failures) == len(item.choices) else "ok"
                else:
                    outcome.status = "error"
                    yield _event(_failure(item.error).body())
        except _Stopping:
            outcome.status = "error"
            yield _event(shutting_down().body())
        if not isinstance(answer, InfillAnswer):
            yield "data: [DONE]\n\n"
    except ClientGone:
        outcome.status = "cancelled"
    finally:
        job.cancel()
        outcome.record()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
