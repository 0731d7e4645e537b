"""What a web page can make `ssdlocal serve` do: nothing, unless the user allows its origin.

Raw HTTP requests as a browser would send them, against an AR server on 127.0.0.1:
- DNS rebinding: a Host the server does not answer to gets 403 before the body is read,
  on every route; localhost, 127.0.0.1 and [::1] (alone or with the port) pass;
- cross-site POSTs that need no preflight (text/plain, form, untyped bodies): 415;
- a disallowed Origin (another site, `null`): 403, preflights included; the server's own
  origin passes; allowed origins get CORS headers and answered preflights (AccessPolicy
  and the gate, without a server);
- heads over 16 KiB (one long header, or thousands of short ones): 400.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from support.server import MODEL, LiveServer

pytest.importorskip("uvicorn")

from ssdlocal.core.config import EngineConfig, ModelSpec
from ssdlocal.core.errors import UsageError
from ssdlocal.server.gate import AccessPolicy, guard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
CHAT = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def live(tiny_dir):
    server = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")))
    yield server
    server.close()


def request(
    live: LiveServer,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    send_body: bool = True,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request (Connection: close) -> status, headers (lowercase), body.
    `send_body` False declares the body's length but never sends it."""
    fields = {"Host": live.host, **(headers or {})}
    if body or method == "POST":
        fields.setdefault("Content-Length", str(len(body)))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    with socket.create_connection(("127.0.0.1", live.port), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + b"Connection: close\r\n\r\n" + (body if send_body else b""))
        data = b""
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        raw_head, _, payload = data.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        parsed = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(parsed.get("content-length", 1 << 40))
        while len(payload) < length and (chunk := sock.recv(65536)):  # the server need not wait for the body
            payload += chunk
    return int(lines[0].split()[1]), parsed, payload[:length]


def error_code(payload: bytes) -> str:
    body = json.loads(payload)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["code"]


# ----------------------------------------------------------------------------- DNS rebinding
@pytest.mark.parametrize(
    "host",
    [
        "attacker.example",
        "attacker.example:{port}",
        "127.0.0.1.nip.io:{port}",
        "localhost.attacker.example:{port}",
        "localhost:1",
        "127.0.0.1:{other}",
        "",
    ],
)
def test_a_host_the_server_does_not_answer_to_is_refused_before_the_body(live, host):
    host = host.format(port=live.port, other=live.port + 1)
    started = time.perf_counter()
    status, _, payload = request(
        live, "POST", "/v1/chat/completions", {"Host": host, "Content-Type": "application/json"}, CHAT, send_body=False
    )
    assert status == 403 and error_code(payload) == "host_not_allowed", payload
    assert "--allowed-hosts" in json.loads(payload)["error"]["message"]
    assert time.perf_counter() - started < 5  # not waiting for the body (it never comes)
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/health"), ("GET", "/nowhere")]:
        status, _, payload = request(live, method, path, {"Host": host})
        assert status == 403 and error_code(payload) == "host_not_allowed", (path, payload)


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}", "[::1]:{port}", "localhost", "127.0.0.1"]
)
def test_the_names_the_server_is_reachable_as_are_answered(live, host):
    status, _, payload = request(
        live,
        "POST",
        "/v1/completions",
        {"Host": host.format(port=live.port), "Content-Type": "application/json"},
        COMPLETION,
    )
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 2, payload


# ----------------------------------------------------------------------------- simple cross-site POSTs
@pytest.mark.parametrize(
    "kind",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
        "application/jsonx",
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_json_route_refuses_bodies_not_typed_as_json(live, path, kind):
    body = COMPLETION if path == "/v1/completions" else CHAT
    status, _, payload = request(live, "POST", path, {"Content-Type": kind}, body)
    assert status == 415 and error_code(payload) == "unsupported_media_type", payload
    assert "application/json" in json.loads(payload)["error"]["message"]


def test_json_with_a_charset_is_json(live):
    status, _, payload = request(
        live, "POST", "/v1/completions", {"Content-Type": "Application/JSON; charset=utf-8"}, COMPLETION
    )
    assert status == 200, payload


# ----------------------------------------------------------------------------- Origin
@pytest.mark.parametrize(
    "origin",
    ["https://evil.example", "null", "http://127.0.0.1:{other}", "http://localhost.evil.example:{port}", "file://"],
)
def test_a_web_page_of_another_origin_is_refused(live, origin):
    origin = origin.format(port=live.port, other=live.port + 1)
    json_type = {"Content-Type": "application/json", "Origin": origin}
    status, headers, payload = request(live, "POST", "/v1/completions", json_type, COMPLETION, send_body=False)
    assert status == 403 and error_code(payload) == "origin_not_allowed", payload
    assert "access-control-allow-origin" not in headers
    status, _, payload = request(
        live, "POST", "/v1/completions", {**json_type, "Content-Type": "text/plain"}, COMPLETION
    )
    assert status == 403, payload  # refused as an origin, whatever the body
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    status, headers, payload = request(live, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 403 and "access-control-allow-origin" not in headers, (status, headers)
    status, _, payload = request(live, "GET", "/v1/models", {"Origin": origin})
    assert status == 403, payload


def test_the_servers_own_origin_passes(live):
    own = f"http://127.0.0.1:{live.port}"
    status, headers, payload = request(
        live, "POST", "/v1/completions", {"Content-Type": "application/json", "Origin": own}, COMPLETION
    )
    assert status == 200 and headers["access-control-allow-origin"] == own, payload


# ----------------------------------------------------------------------------- heads
@pytest.mark.parametrize("extra", [{"X-Long": "a" * 20_000}, {f"X-H{i}": "aaaaaaa" for i in range(3000)}])
def test_a_head_over_16_kib_gets_400(live, extra):
    status, _, payload = request(live, "GET", "/v1/models", extra)
    assert status == 400 and error_code(payload) == "invalid_http_request", payload
    status, _, payload = request(live, "GET", "/v1/models", {"X-Fits": "a" * 15_000})
    assert status == 200, payload


# ----------------------------------------------------------------------------- the policy itself
def test_allowed_hosts_and_origins_extend_the_defaults():
    policy = AccessPolicy("127.0.0.1", 8000, ("my-box.lan", "proxy.lan:443"), ("http://localhost:3000",))
    assert policy.host_allowed("my-box.lan") and policy.host_allowed("my-box.lan:9999")
    assert policy.host_allowed("proxy.lan:443") and not policy.host_allowed("proxy.lan:8000")
    assert not policy.host_allowed("evil.lan:8000") and not policy.host_allowed("my-box.lan.evil:8000")
    assert policy.origin_allowed("http://localhost:3000") and policy.origin_allowed("HTTP://LOCALHOST:3000/")
    assert not policy.origin_allowed("http://localhost:3001") and not policy.origin_allowed("https://localhost:3000")
    assert policy.origin_allowed("http://localhost:8000") and not policy.origin_allowed("null")
    wide = AccessPolicy("0.0.0.0", 8000)  # all interfaces: any IP literal, still no foreign names
    assert wide.host_allowed("192.168.1.7:8000") and wide.host_allowed("[fe80::1]:8000")
    assert not wide.host_allowed("attacker.example:8000") and not wide.host_allowed("0.0.0.0.nip.io:8000")
    named = AccessPolicy("my-box.lan", 8000)  # --host NAME: that name too
    assert named.host_allowed("my-box.lan:8000") and not named.host_allowed("other.lan:8000")
    assert AccessPolicy("127.0.0.1", 8000, ("*",)).host_allowed("anything.example")
    assert AccessPolicy("127.0.0.1", 8000, (), ("*",)).origin_allowed("null")
    for bad in [
        {"extra_hosts": ("a b",)},
        {"extra_hosts": ("host:port",)},
        {"extra_origins": ("localhost:3000",)},
        {"extra_origins": ("ftp://x",)},
        {"extra_origins": ("http://x/path",)},
    ]:
        with pytest.raises(UsageError):
            AccessPolicy("127.0.0.1", 8000, **bad)


def _call(app, method: str, headers: dict[str, str], path: str = "/v1/completions") -> tuple[int, dict, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_an_allowed_origin_gets_cors_headers_and_its_preflight_answered():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    gated = guard(app, AccessPolicy("127.0.0.1", 8000, (), ("http://localhost:3000",)))
    page = {"Host": "127.0.0.1:8000", "Origin": "http://localhost:3000"}
    status, headers, _ = _call(gated, "OPTIONS", {**page, "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "content-type" in headers["access-control-allow-headers"].lower()
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, body = _call(gated, "POST", {**page, "Content-Type": "application/json"})
    assert (status, body) == (200, b"ok") and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert headers["vary"] == "Origin"
    status, headers, _ = _call(gated, "POST", {"Host": "127.0.0.1:8000", "Content-Type": "application/json"})
    assert status == 200 and "access-control-allow-origin" not in headers  # no Origin: no CORS headers
    status, headers, _ = _call(
        gated, "OPTIONS", {**page, "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert status == 403 and "access-control-allow-origin" not in headers
