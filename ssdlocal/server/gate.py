"""What a request must satisfy before any route sees it (nothing of its body is read yet).

A head within 16 KiB (400); a `Host` this server answers to (403: DNS rebinding, where a
page on a hostile name that resolves to 127.0.0.1 becomes same-origin with the server);
an `Origin`, when a browser sends one, that is allowed (403: any other web page); and a
JSON body typed `application/json` (415: a page may POST `text/plain`, form or untyped
bodies to any address without asking the server first). Allowed origins get CORS
headers and their preflights answered; nothing else does. Knows nothing of the engine.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ssdlocal.core.errors import UsageError

MAX_HEAD_BYTES = 16 * 1024  # a request line plus headers
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARDS = ("0.0.0.0", "::", "[::]", "")
JSON_ROUTES = ("/v1/completions", "/v1/chat/completions")
CORS_METHODS = "GET, POST"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE_S = 600
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_.])?")  # a DNS name or an IPv4 address


def _bracketed(host: str) -> str:
    """An IPv6 literal as a Host header writes it ([::1]); anything else lowercased."""
    host = host.strip().lower()
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def split_host(value: str) -> tuple[str, int | None]:
    """`name[:port]` (IPv6 in brackets) -> (name, port or None). ValueError if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(value)
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, _, port = value.partition(":")
        rest = f":{port}" if _ else ""
    if not (_NAME.fullmatch(name) or (name.startswith("[") and _is_ip(name))):
        raise ValueError(value)
    if not rest:
        return name, None
    if not (rest.startswith(":") and rest[1:].isdigit() and int(rest[1:]) <= 65535):
        raise ValueError(value)
    return name, int(rest[1:])


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AccessPolicy:
    """Which Host and Origin headers the server accepts (docs/hardening.md, "What a web page can and cannot do").

    Hosts: localhost, 127.0.0.1, [::1] and the listening host, each alone or with the
    listening port; any IP address when listening on all interfaces (a rebinding attack
    needs a name); plus `extra_hosts` (`name` any port, `name:port` that port; `*` any
    Host). Origins: the server's own (`http://` + an accepted host and port) plus
    `extra_origins` (`*`: any). `port` None accepts the built-in names on any port."""

    host: str = "127.0.0.1"
    port: int | None = None
    extra_hosts: tuple[str, ...] = ()
    extra_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in self.extra_hosts:
            if entry != "*":
                try:
                    split_host(entry)
                except ValueError:
                    raise UsageError(
                        f"--allowed-hosts: {entry!r} is not a host name (optionally with :port)",
                        "use e.g. --allowed-hosts my-box.lan or --allowed-hosts my-box.lan:8000",
                    ) from None
        for entry in self.extra_origins:
            if entry != "*" and normal_origin(entry) is None:
                raise UsageError(
                    f"--allowed-origins: {entry!r} is not an origin (scheme://host[:port])",
                    "use e.g. --allowed-origins http://localhost:3000",
                )

    @property
    def names(self) -> tuple[str, ...]:
        """The built-in host names (without ports)."""
        own = _bracketed(self.host)
        return LOOPBACK_NAMES + (() if own in WILDCARDS or own in LOOPBACK_NAMES else (own,))

    @property
    def any_ip(self) -> bool:
        return _bracketed(self.host) in WILDCARDS

    def host_allowed(self, value: str | None) -> bool:
        if "*" in self.extra_hosts:
            return True
        if not value:
            return False
        try:
            name, port = split_host(value)
        except ValueError:
            return False
        if name in self.names or (self.any_ip and _is_ip(name)):
            return port is None or self.port is None or port == self.port
        for entry in self.extra_hosts:
            want_name, want_port = split_host(entry)
            if name == want_name and (want_port is None or port == want_port):
                return True
        return False

    def origin_allowed(self, value: str) -> bool:
        if "*" in self.extra_origins:
            return True
        origin = normal_origin(value)
        if origin is None:  # "null" (sandboxed frames, file: pages), or garbage
            return False
        if origin in {normal_origin(o) for o in self.extra_origins}:
            return True
        scheme, _, rest = origin.partition("://")
        name, port = split_host(rest)
        own = name in self.names or (self.any_ip and _is_ip(name))
        return scheme == "http" and own and (self.port is None or (port or 80) == self.port)

    def describe_hosts(self) -> str:
        port = f" (alone or with :{self.port})" if self.port is not None else ""
        names = ", ".join(self.names) + port
        if self.any_ip:
            names += ", any IP address of this machine"
        extra = [e for e in self.extra_hosts if e != "*"]
        return names + (f", {', '.join(extra)}" if extra else "")


def normal_origin(value: str) -> str | None:
    """`scheme://host[:port]` lowercased, default ports dropped; None if it is not one."""
    value = value.strip().lower().rstrip("/")
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        return None
    try:
        name, port = split_host(rest)
    except ValueError:
        return None
    if port == {"http": 80, "https": 443}[scheme]:
        port = None
    return f"{scheme}://{name}" + ("" if port is None else f":{port}")


def _error(status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()):
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return head, body


def _shown(value: str) -> str:
    value = value.encode("ascii", "backslashreplace").decode()
    return value if len(value) <= 80 else value[:77] + "..."


def guard(app: Callable[..., Awaitable[None]], policy: AccessPolicy) -> Callable[..., Awaitable[None]]:
    """`app` behind the checks above (HTTP requests only; answers before the body is read)."""

    async def gated(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = {}
        head_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
        for name, value in scope["headers"]:
            head_bytes += len(name) + len(value) + 4
            headers.setdefault(name, value)
        refusal = _refusal(scope, headers, head_bytes, policy)
        if refusal is not None:
            status, head, body = refusal
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": body})
            return
        origin = headers.get(b"origin")
        if origin is None:
            await app(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [
                        *cors,
                        (b"access-control-allow-methods", CORS_METHODS.encode()),
                        (b"access-control-allow-headers", CORS_HEADERS.encode()),
                        (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
                        (b"content-length", b"0"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await app(scope, receive, with_cors)

    return gated


def _refusal(scope, headers: dict[bytes, bytes], head_bytes: int, policy: AccessPolicy):
    """(status, headers, body) for a request refused before its route, or None."""
    if head_bytes > MAX_HEAD_BYTES:
        return 400, *_error(
            400,
            f"the request's head has about {head_bytes:,} bytes, over this server's limit "
            f"of {MAX_HEAD_BYTES:,} (16 KiB)",
            "invalid_http_request",
        )
    host = headers.get(b"host", b"").decode("latin-1")
    if not policy.host_allowed(host):
        return 403, *_error(
            403,
            f"this server does not answer to the Host {_shown(host)!r} (a guard against DNS rebinding): "
            f"it answers to {policy.describe_hosts()}; start it with --allowed-hosts to add a name",
            "host_not_allowed",
        )
    origin = headers.get(b"origin")
    if origin is not None and not policy.origin_allowed(origin.decode("latin-1")):
        return 403, *_error(
            403,
            f"requests from the web page origin {_shown(origin.decode('latin-1'))!r} are not allowed; "
            "start the server with --allowed-origins ORIGIN to let that page use it",
            "origin_not_allowed",
        )
    if scope["method"] == "POST" and scope["path"] in JSON_ROUTES:
        kind = headers.get(b"content-type", b"").decode("latin-1")
        if kind.split(";", 1)[0].strip().lower() != "application/json":
            shown = f"{_shown(kind)!r}" if kind else "none"
            return 415, *_error(
                415,
                f"the request body must be sent as Content-Type: application/json (got {shown})",
                "unsupported_media_type",
            )
    return None
