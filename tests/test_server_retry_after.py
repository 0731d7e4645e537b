"""Every 503 and 429 the server sends carries `Retry-After` (seconds).

The paths are enumerated from the code: `test_every_503_and_429_in_the_server_is_one_of_these`
reads ssdlocal/server/ for the status literals and fails when one appears outside the
table below, so a new "later" answer needs a test here. Each path then runs against a
live AR server on the 1-layer tiny model: a connection past --max-connections (the canned
answer written before the request is read), a grammar compile queue that is full, a request
arriving while the server stops (the same error ends answers in flight and bodies still
arriving), and /health once the engine thread has stopped. APIError adds the header to any
429 / 503 built without one, so an error body of a later path has it too.
"""

from __future__ import annotations

import ast
import json
import select
import socket
import time
from pathlib import Path

import pytest
from support.server import MODEL, LiveServer

pytest.importorskip("openai")

from ssdlocal.core.config import EngineConfig, ModelSpec
from ssdlocal.grammar.refusals import GrammarError
from ssdlocal.server.limits import ServerLimits, shutting_down
from ssdlocal.server.protocol import RETRY_AFTER_S, APIError

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "ssdlocal" / "server"
# (module, function) holding a 503 or 429 literal -> the test below that answers through it
PATHS = {
    ("connections.py", "protocol_class"): "test_a_connection_past_the_limit_is_told_when_to_retry",
    ("grammars.py", "for_request"): "test_a_full_grammar_queue_is_told_when_to_retry",
    ("limits.py", "shutting_down"): "test_a_request_while_the_server_stops_is_told_when_to_retry",
    ("app.py", "health"): "test_health_with_the_engine_stopped_says_when_to_retry",
    ("protocol.py", "<module>"): "test_an_api_error_of_503_or_429_always_has_retry_after",  # RETRY_STATUSES
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _statuses_in(path: Path) -> set[tuple[str, str]]:
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Constant) and child.value in (503, 429) and type(child.value) is int:
                found.add((path.name, where))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_every_503_and_429_in_the_server_is_one_of_these():
    found = set().union(*(_statuses_in(p) for p in sorted(SERVER.glob("*.py"))))
    assert found == set(PATHS), f"paths without a Retry-After test: {found - set(PATHS)}; gone: {set(PATHS) - found}"
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(PATHS.values()) <= tests


def test_an_api_error_of_503_or_429_always_has_retry_after():
    for status in (429, 503):
        assert APIError(status, "later").headers == {"Retry-After": str(RETRY_AFTER_S)}
        kept = APIError(status, "later", headers={"Retry-After": "2", "Connection": "close"})
        assert kept.headers == {"Retry-After": "2", "Connection": "close"}  # a cause's own wait is kept
    assert APIError(400, "no").headers is None and APIError(500, "no").headers is None
    assert shutting_down().headers == {"Retry-After": str(RETRY_AFTER_S)}


@pytest.fixture(scope="module")
def live(tiny_dir):
    limits = ServerLimits(max_connections=3, header_timeout_s=2.0)
    server = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")), limits=limits)
    yield server
    server.close()


def _chat(**fields) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0, **fields}
    ).encode()


def _head(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, payload


def test_a_connection_past_the_limit_is_told_when_to_retry(live):
    live.client.close()  # its kept-alive connections would count too
    opened = [socket.create_connection(("127.0.0.1", live.port), timeout=5) for _ in range(4)]
    try:
        deadline, answer = time.monotonic() + 3, b""
        while not answer and time.monotonic() < deadline:
            for sock in select.select(opened, [], [], 0.1)[0]:
                answer = sock.recv(4096)
        status, headers, payload = _head(answer)
        assert status == 503 and json.loads(payload)["error"]["code"] == "too_many_connections"
        assert int(headers["retry-after"]) >= 1
    finally:
        for sock in opened:
            sock.close()
    time.sleep(0.2)


def test_a_full_grammar_queue_is_told_when_to_retry(live, monkeypatch):
    def busy(*args, **kwargs):
        raise GrammarError("8 grammar compiles are waiting", "try again shortly", reason="busy")

    monkeypatch.setattr(live.state.grammars.compiler, "compile", busy)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    status, reply = live.post("/v1/chat/completions", _chat(response_format=fmt))
    assert status == 503 and reply["error"]["code"] == "grammar_compiles_busy", reply
    assert live.last_headers["retry-after"] == "2"


def test_a_request_while_the_server_stops_is_told_when_to_retry(live):
    live.state.closing.set()  # what the server's shutdown does first; no request is in flight
    try:
        status, reply = live.post("/v1/chat/completions", _chat())
    finally:
        live.state.closing.clear()
    assert status == 503 and reply["error"]["code"] == "server_shutting_down", reply
    assert live.last_headers["retry-after"] == str(RETRY_AFTER_S)
    status, reply = live.post("/v1/chat/completions", _chat())
    assert status == 200, reply


def test_health_with_the_engine_stopped_says_when_to_retry(tiny_dir):
    live = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")))
    try:
        status, _ = live.get("/health")
        assert status == 200 and "retry-after" not in live.last_headers
        live.scheduler.stop()  # the engine thread is gone; the HTTP side still answers
        status, text = live.get("/health")
        assert status == 503 and json.loads(text) == {"status": "engine stopped"}
        assert live.last_headers["retry-after"] == str(RETRY_AFTER_S)
    finally:
        live.close()
