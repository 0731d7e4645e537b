"""One streamed OpenAI request, timed on the client: POST, read the server-sent events,
note when the first token arrives and when the answer ends. A stream that ends without
a finish reason (an answer cut off) counts as a failed request.

`timed_request` returns a RequestTiming (the client's clock) and the Reply (text, tool
calls) the client continues from. The first token is the first chunk carrying text or a
tool call (a role-only opening chunk does not count). Tokens are the server's `usage`
when it sends one, else the chunks that carried text (`tokens_from` says which). A
server's per-request stats (ssdlocal's `ssdlocal` object) give its own time to first
token and, where present, a queue time. Standard library only (http.client).
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass

from ssdlocal.bench.clients import Reply

QUEUE_FIELDS = ("queue_s", "queue_time_s", "queued_s")  # a server's stats name for submit -> running


@dataclass(frozen=True)
class RequestTiming:
    """One request as measured; times in seconds from the workload's start (`start_s`) or
    from this request's start (the rest). `error` set: the request failed, no timings."""

    client: int
    kind: str
    start_s: float
    ttft_s: float | None = None  # first text / tool-call chunk, client clock
    total_s: float | None = None  # last byte of the answer, client clock
    completion_tokens: int = 0
    tokens_from: str = "usage"  # "usage" (the server's count) | "chunks" (text chunks seen)
    prompt_tokens: int | None = None
    server_ttft_s: float | None = None  # the server's own submit -> first token
    queue_s: float | None = None  # the server's submit -> running, when it reports one
    finish_reason: str | None = None
    tool_calls: int = 0
    error: str | None = None


def timed_request(
    host: str, port: int, path: str, body: dict, *, client: int, kind: str, t0: float, timeout_s: float = 600.0
) -> tuple[RequestTiming, Reply]:
    """Send `body` to `path` as one streamed request and time it (t0: the workload's start,
    time.perf_counter()). Network errors and non-200 answers become `error`, never raise."""
    start = time.perf_counter()
    reply = Reply()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(400).decode("utf-8", "replace")
            return RequestTiming(client, kind, start - t0, error=f"HTTP {resp.status}: {detail}"), reply
        seen = _read_events(resp, reply)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestTiming(client, kind, start - t0, error=f"{type(exc).__name__}: {exc}"), reply
    finally:
        conn.close()
    end = time.perf_counter()
    if reply.finish_reason is None:  # e.g. a server that cut this answer off for another request
        return RequestTiming(
            client, kind, start - t0, total_s=end - start, error="the stream ended without a finish reason (cut off)"
        ), reply
    usage, stats = seen["usage"], seen["stats"] or {}
    queue = next((stats[f] for f in QUEUE_FIELDS if stats.get(f) is not None), None)
    timing = RequestTiming(
        client,
        kind,
        start - t0,
        ttft_s=None if seen["first"] is None else seen["first"] - start,
        total_s=end - start,
        completion_tokens=usage["completion_tokens"] if usage else seen["chunks"],
        tokens_from="usage" if usage else "chunks",
        prompt_tokens=usage and usage.get("prompt_tokens"),
        server_ttft_s=stats.get("ttft_s"),
        queue_s=queue,
        finish_reason=reply.finish_reason,
        tool_calls=len(reply.tool_calls),
    )
    return timing, reply


def _read_events(resp, reply: Reply) -> dict:
    """Fold the event stream into `reply`; return first-token time, text chunks, usage, stats."""
    seen = {"first": None, "chunks": 0, "usage": None, "stats": None}
    calls: dict[int, dict] = {}
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, pings
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        seen["usage"] = chunk.get("usage") or seen["usage"]
        seen["stats"] = chunk.get("ssdlocal") or seen["stats"]
        got = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = choice.get("text") if "text" in choice else delta.get("content")
            if text:
                reply.text += text
                got = True
            for call in delta.get("tool_calls") or ():
                got = True
                slot = calls.setdefault(
                    call.get("index", len(calls)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        if got:
            seen["chunks"] += 1
            if seen["first"] is None:
                seen["first"] = time.perf_counter()
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    for n, call in enumerate(reply.tool_calls):  # the tool answers name the call they answer
        call["id"] = call["id"] or f"call_{n}"
    return seen
