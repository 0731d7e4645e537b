"""Connections: uvicorn's HTTP/1.1 (h11) protocol with the limits uvicorn lacks.

At most `max_connections` open at once (one more is answered 503 with Retry-After and
closed before its request is read); a deadline for each request's head, counted from the
connection's start or the previous answer (silent connections and half-sent headers are closed);
OpenAI-shaped 400s for malformed heads and body framing (a chunk size that is not hex);
a lingering close when the client is still sending a body that was answered unread
(413, 403), so that clients which send the whole body before reading (urllib, requests,
httpx) read the answer instead of a connection reset. `quiet_accept_errors` reports the event
loop's accept failures (EMFILE: out of file descriptors) in one log line, not one
traceback per attempt; `fit_connections` makes room for the connections in the process's
open-file limit. Knows nothing of routes or the engine.
"""

from __future__ import annotations

import errno
import json
import logging
import time

from ssdlocal.server.limits import ServerLimits

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors besides connections: model files, pipes, the listener, logs
LINGER_IDLE_S = 2.0  # a lingering close ends once the client sends nothing for this long
ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
BUSY_RETRY_AFTER_S = 1  # a connection frees when any answer ends


def _error_response(status: int, reason: str, message: str, kind: str, code: str, retry_after_s: int = 0) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{retry}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class RateLimitedLog:
    """One warning, then at most one per `every_s` seconds saying how many were held back."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        log.warning(message + (f" ({held} more since the last report)" if held else ""), *args)


def protocol_class(limits: ServerLimits):
    """uvicorn's h11 protocol class, with the connection limit and the head deadline."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refused = RateLimitedLog()
    busy = _error_response(
        503,
        "Service Unavailable",
        f"too many open connections (this server allows {limits.max_connections}, --max-connections); retry shortly",
        "server_error",
        "too_many_connections",
        retry_after_s=BUSY_RETRY_AFTER_S,
    )
    bad_request = _error_response(
        400,
        "Bad Request",
        "the request's head cannot be parsed as HTTP/1.1 (malformed, or over 16 KiB)",
        "invalid_request_error",
        "invalid_http_request",
    )
    bad_body = _error_response(
        400,
        "Bad Request",
        "the request's body framing cannot be parsed as HTTP/1.1 (e.g. a chunk size that is not hexadecimal)",
        "invalid_request_error",
        "invalid_http_request",
    )

    class LimitedH11Protocol(H11Protocol):
        _head_timer = None
        _linger_timer = None
        _linger_until = 0.0
        _lingering = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._raw = transport
            self.transport = _LingeringTransport(transport, self)  # what uvicorn's cycles close
            if len(self.connections) > limits.max_connections:
                refused.warning("%d connections open: refusing new ones (--max-connections)", len(self.connections) - 1)
                transport.write(busy)
                transport.close()
                return
            self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # answered and closing: what the client still sends is dropped
                self._arm_linger()
                return
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            for timer in (self._head_timer, self._linger_timer):
                if timer is not None:
                    timer.cancel()
            self._head_timer = self._linger_timer = None
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._lingering:
                self._raw.close()
                return
            super().shutdown()

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_deadline)

        def _head_deadline(self) -> None:
            """No request is being answered: the connection is waiting for a head (or
            sending the rest of a body already answered, e.g. with 413). Close it."""
            self._head_timer = None
            if self.transport.is_closing() or not (self.cycle is None or self.cycle.response_complete):
                return  # a request head arrived: its body and answer have deadlines of their own
            log.debug("closing a connection: no request head within %g s", limits.header_timeout_s)
            self._raw.close()

        def close(self, *, linger: bool = False) -> None:
            """Close the connection; lingering (answer sent, our side shut, the client's
            data read and dropped until it closes, is silent for LINGER_IDLE_S, or
            --body-timeout passed) when asked or while a request body is still coming."""
            if self._raw.is_closing() or self._lingering:
                return
            if not (linger or self.conn.their_state is h11.SEND_BODY):
                self._raw.close()
                return
            self._lingering = True
            self._linger_until = self.loop.time() + limits.body_timeout_s
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._raw.can_write_eof():
                self._raw.write_eof()  # after the answer still buffered
            self._raw.resume_reading()
            self._arm_linger()

        def _arm_linger(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            wait = min(LINGER_IDLE_S, self._linger_until - self.loop.time())
            self._linger_timer = self.loop.call_later(max(0.0, wait), self._raw.close)

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse: a malformed head (or one over h11's 16 KiB) or
            body framing. OpenAI's body, unless an answer is already under way (then only
            close); the route waiting for that body sees the client gone."""
            if self.conn.our_state is h11.IDLE:
                self._raw.write(bad_request)
            elif self.cycle is not None and not self.cycle.response_started:
                self._raw.write(bad_body)
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.close(linger=True)

    return LimitedH11Protocol


class _LingeringTransport:
    """A connection's transport as uvicorn sees it: `close()` goes through the protocol
    (which may linger), and a lingering connection counts as closing."""

    def __init__(self, transport, protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol._lingering

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def quiet_accept_errors(loop) -> None:
    """Report the loop's accept failures (out of descriptors or memory) as one warning
    line now and then; asyncio's default handler logs a traceback per failed accept,
    and retries every accept in the backlog on each wake-up."""
    reports = RateLimitedLog()
    default = loop.get_exception_handler()

    def handler(loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRORS and "accept" in context.get("message", ""):
            reports.warning(
                "cannot accept connections: %s (raise `ulimit -n`, or lower --max-connections); retrying every second",
                exc.strerror or exc,
            )
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def fit_connections(max_connections: int) -> int:
    """Connections that fit the open-file limit: raise the soft limit toward the hard one
    if needed; if that is not enough, warn and return the number that fits."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to manage
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft >= need:
        return max_connections
    fits = max(1, soft - FD_RESERVE)
    log.warning(
        "the open-file limit (%d) leaves room for %d connections, not %d: serving at most %d "
        "(raise `ulimit -n` for more)",
        soft,
        fits,
        max_connections,
        fits,
    )
    return fits
