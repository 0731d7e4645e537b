"""`ssdlocal serve` against hostile and careless clients: every limit answers with
OpenAI's error body, fast, before anything costly runs, and the server goes on.

- bodies over --max-body-mb: 413 unread; prompts over --max-prompt-chars: 400 before
  the tokenizer; a token-id request is not held up by another request's tokenizing;
- rows (prompts x n) over --max-request-rows: 400; fewer run in engine calls of at
  most --max-batch rows, each equal to its result alone;
- stop strings bounded in count and length;
- deep JSON nesting, lone surrogates, a chat template that refuses: 400, no internal text;
- silent connections, half-sent heads and bodies that never arrive are closed (408 for
  the body); connections past --max-connections get 503; running out of descriptors
  is logged once, and the server recovers;
- --max-new-tokens without max_tokens: min(cap, room left in the context);
- sampling errors name their field.

One AR server on the 1-layer tiny model for the module (short deadlines, small limits),
on 127.0.0.1; raw sockets always have timeouts.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.server import MODEL, LiveServer

openai = pytest.importorskip("openai")

from ssdlocal.core.config import EngineConfig, ModelSpec
from ssdlocal.server.limits import MiB, ServerLimits

ROOT = Path(__file__).resolve().parent.parent
LIMITS = ServerLimits(
    max_body_bytes=4 * MiB, max_request_rows=16, max_connections=12, header_timeout_s=1.0, body_timeout_s=1.0
)
CAP = 64  # the server's --max-new-tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def live(tiny_dir):
    server = LiveServer(
        EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")),
        limits=LIMITS,
        max_batch=4,
        max_new_tokens=CAP,
    )
    yield server
    server.close()


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **fields}).encode()


def assert_error(status: int, reply: dict, expected: int, param=None, code=None) -> dict:
    assert status == expected, reply
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["param"] == param and (code is None or reply["error"]["code"] == code), reply
    for leak in ("Traceback", "Error:", "Error(", 'File "'):
        assert leak not in reply["error"]["message"], reply
    return reply["error"]


def assert_still_serving(live: LiveServer) -> None:
    status, reply = live.post("/v1/completions", body())
    assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply


def count_calls(monkeypatch, obj, name: str) -> list:
    calls, real = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def connect(live: LiveServer, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (socket timeout: the test fails, never hangs)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# ----------------------------------------------------------------------------- row 2
def test_a_body_over_the_limit_is_refused_unread(live, monkeypatch):
    encodes = count_calls(monkeypatch, live.state, "encode")
    started = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as info:  # 50 MB, as the official client sends it
        live.client.completions.create(model=MODEL, prompt="x" * 50_000_000, max_tokens=2)
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    assert "--max-body-mb" in info.value.body["message"]
    assert time.perf_counter() - started < 5
    with connect(live) as sock:  # no declared length: refused once the limit is passed
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % live.host.encode()
        )
        chunk = b"x" * MiB
        for _ in range(5):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert not encodes
    assert_still_serving(live)


def test_clients_that_send_the_whole_body_before_reading_get_the_413(live):
    """urllib and requests send `Connection: close` and the whole body before reading: the
    server answers at once and then reads and drops the rest (a lingering close), so they
    read the 413 instead of a connection reset or a broken pipe."""
    import urllib.error
    import urllib.request

    def chunks():  # no length: chunked, refused once past the limit
        for _ in range(50):
            yield b"x" * MiB

    for data in (b"x" * 50_000_000, chunks()):
        req = urllib.request.Request(
            f"{live.url}/v1/completions", data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 413 and json.loads(info.value.read())["error"]["code"] == "request_too_large"
    requests = pytest.importorskip("requests")
    reply = requests.post(
        f"{live.url}/v1/completions",
        data=b"x" * 50_000_000,
        timeout=30,
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert_still_serving(live)


@pytest.mark.parametrize("pause", [0.0, 0.3])  # in the head's packet, or once the route waits for the body
def test_a_malformed_chunk_size_gets_400(live, pause):
    with connect(live) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % live.host.encode()
        )
        time.sleep(pause)
        sock.sendall(b"zz\r\n{}\r\n0\r\n\r\n")
        answer = read_all(sock)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert_error(400, json.loads(payload), 400, None, "invalid_http_request")
    assert_still_serving(live)


def test_prompt_characters_are_bounded_before_tokenizing(live, monkeypatch):
    limit = LIMITS.prompt_chars(live.engine.context)
    assert limit == 32 * live.engine.context
    encodes = count_calls(monkeypatch, live.state, "encode")
    status, reply = live.post("/v1/completions", body(prompt=["Hello", "y" * limit]))
    assert "--max-prompt-chars" in assert_error(status, reply, 400, "prompt", "context_length_exceeded")["message"]
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "z" * (limit + 1)}]}).encode()
    assert_error(*live.post("/v1/chat/completions", chat), 400, "messages", "context_length_exceeded")
    many = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * (live.engine.context + 1)})
    assert_error(*live.post("/v1/chat/completions", many.encode()), 400, "messages", "context_length_exceeded")
    assert not encodes


def test_the_prompt_limit_counts_tools_calls_and_schemas_before_rendering(live, monkeypatch):
    """Issue 33 item 5: a huge tool description, tool-call arguments, tool result id or
    schema is refused like an oversized message: before the template renders it."""
    limit = LIMITS.prompt_chars(live.engine.context)
    encodes = count_calls(monkeypatch, live.state, "encode")
    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "description": "d" * limit}}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * limit}}],
    }
    result = {"role": "tool", "tool_call_id": "i" * limit, "content": "ok"}
    for extra in (
        {"messages": [user], "tools": [tool], "tool_choice": "none"},
        {"messages": [user, call, {"role": "user", "content": "and?"}]},
        {
            "messages": [
                user,
                {
                    **call,
                    "tool_calls": [{**call["tool_calls"][0], "id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                result,
            ]
        },
    ):
        request = json.dumps({"model": MODEL, "max_tokens": 2, **extra}).encode()
        started = time.perf_counter()
        error = assert_error(*live.post("/v1/chat/completions", request), 400, "messages", "context_length_exceeded")
        assert "--max-prompt-chars" in error["message"] and time.perf_counter() - started < 5
    assert not encodes


def test_a_token_id_request_is_not_held_up_by_another_requests_tokenizing(live, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    real = live.state.tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow"):
            inside.set()
            release.wait(10)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(live.state.tokenizer, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(live.post, "/v1/completions", body(prompt="slow prompt"))
        assert inside.wait(10)
        started = time.perf_counter()
        status, reply = live.post("/v1/completions", body(prompt=[5, 6, 7]))
        waited = time.perf_counter() - started
        release.set()
        assert status == 200 and slow.result(timeout=30)[0] == 200
    assert waited < 5, waited


# ----------------------------------------------------------------------------- row 3
def test_rows_per_request_are_bounded_and_run_in_batches_of_max_batch(live, monkeypatch):
    encodes = count_calls(monkeypatch, live.state, "encode")
    started = time.perf_counter()
    status, reply = live.post("/v1/completions", body(prompt=["Hello world"] * 1000, n=16))
    assert "--max-request-rows" in assert_error(status, reply, 400, "n")["message"]
    status, reply = live.post("/v1/completions", body(prompt=["Hello world"] * 17))
    assert_error(status, reply, 400, "prompt")
    assert time.perf_counter() - started < 5 and not encodes
    prompts = ["The quick brown fox", "def f(x):", "Once upon a time"]
    reply = live.client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=3,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = [c.model_extra["token_ids"] for c in reply.choices]
    assert [c.index for c in reply.choices] == list(range(9)) and reply.usage.completion_tokens == 45
    for i, prompt in enumerate(prompts):
        alone = live.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert ids[3 * i : 3 * i + 3] == [alone.choices[0].model_extra["token_ids"]] * 3
    assert reply.model_extra["ssdlocal"]["batch_size"] == 4  # 9 rows, never more than --max-batch 4 at once


# ----------------------------------------------------------------------------- row 4
def test_stop_strings_are_bounded_in_count_and_length(live):
    started = time.perf_counter()
    status, reply = live.post("/v1/completions", body(stop=[f"s{i}" for i in range(100_000)]))
    assert_error(status, reply, 400, "stop")
    assert time.perf_counter() - started < 5
    assert_error(*live.post("/v1/completions", body(stop=[f"s{i}" for i in range(17)])), 400, "stop")
    assert_error(*live.post("/v1/completions", body(stop="x" * 65)), 400, "stop")
    status, reply = live.post("/v1/completions", body(stop=[f"{i:02d}" + "q" * 62 for i in range(16)]))
    assert status == 200, reply


# ----------------------------------------------------------------------------- row 5
def test_deep_json_and_lone_surrogates_are_client_errors(live):
    assert_error(*live.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400)
    assert_error(*live.post("/v1/completions", b'{"a":' * 100_000 + b"1" + b"}" * 100_000), 400)
    raw = b'{"model": "tiny", "max_tokens": 2, "prompt": "a\\ud800b"}'
    assert_error(*live.post("/v1/completions", raw), 400, "prompt")
    assert_error(*live.post("/v1/completions", b'{"model": "\\ud800", "prompt": "ab"}'), 400, "model")
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    assert_error(*live.post("/v1/chat/completions", chat), 400, "messages")
    assert_error(*live.post("/v1/completions", b'{"model": "tiny", "prompt": "ab", "\\ud800": 1}'), 400, None)
    assert_error(*live.post("/v1/completions", b"\xff\xfe\x00garbage"), 400)
    huge = json.dumps({"model": "m" * 100_000, "prompt": "ab"}).encode()
    assert len(assert_error(*live.post("/v1/completions", huge), 404, "model")["message"]) < 300
    assert_still_serving(live)


def test_a_chat_template_that_refuses_the_messages_is_a_client_error(live, monkeypatch):
    jinja2 = pytest.importorskip("jinja2")

    def refuse(*args, **kwargs):
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(live.state.tokenizer, "apply_chat_template", refuse)
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 2}).encode()
    error = assert_error(*live.post("/v1/chat/completions", chat), 400, "messages")
    assert "roles must alternate" in error["message"]


# ----------------------------------------------------------------------------- row 6
def test_silent_connections_and_half_sent_heads_are_closed(live):
    started = time.perf_counter()
    with connect(live) as silent, connect(live) as trickle:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        for _ in range(3):  # still sending, but the head is not done within the deadline
            time.sleep(0.25)
            trickle.sendall(b"X-Slow: 1\r\n")
        assert read_all(silent) == b""
        assert read_all(trickle) == b""
    assert time.perf_counter() - started < LIMITS.header_timeout_s + 2
    assert_still_serving(live)


def test_a_body_that_never_arrives_gets_408(live):
    with connect(live) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": ' % live.host.encode()
        )
        answer = read_all(sock)  # the server answers, then closes
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert_error(408, json.loads(payload), 408, None, "request_timeout")
    assert_still_serving(live)


def test_connections_past_the_limit_get_503_and_are_closed(live):
    live.client.close()  # its kept-alive connections would count too
    opened = []
    try:
        for _ in range(LIMITS.max_connections + 1):  # silent: within the head deadline
            opened.append(connect(live))
        first_reads = {}
        deadline = time.monotonic() + 3
        while len(first_reads) < len(opened) and time.monotonic() < deadline:
            waiting = [s for s in opened if s not in first_reads]
            for sock in select.select(waiting, [], [], 0.1)[0]:
                first_reads[sock] = sock.recv(4096)
            if any(first_reads.values()):
                break
        refused = [data for data in first_reads.values() if data]
        assert len(refused) == 1, first_reads
        head, _, payload = refused[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), refused
        assert_error(503, json.loads(payload), 503, None, "too_many_connections")
    finally:
        for sock in opened:
            sock.close()
        live.client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
    time.sleep(0.2)
    assert_still_serving(live)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="descriptor limits via /proc (Linux)")
def test_running_out_of_descriptors_is_logged_once_and_the_server_recovers():
    """A server process with room for about 20 descriptors, and 60 silent connections:
    accepts fail (EMFILE) until the head deadline closes the silent ones."""
    script = """
import os, resource, sys
from ssdlocal.server.limits import ServerLimits
from ssdlocal.server.run import bind, make_server

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

sock = bind("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
make_server(app, limits=ServerLimits(max_connections=1000, header_timeout_s=1.0)).run(sockets=[sock])
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    silent = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(60):  # they stay open: only the head deadline frees their descriptors
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # queued behind them
            sock.settimeout(10)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok"), answer
        assert time.perf_counter() - started < 8
    finally:
        for sock in silent:
            sock.close()
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    reports = [line for line in err.splitlines() if "cannot accept connections" in line]
    assert 1 <= len(reports) <= 2, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) <= 6, err[-3000:]


# ----------------------------------------------------------------------------- row 8
def test_max_new_tokens_caps_answers_within_the_room_left(live):
    context = live.engine.context
    long_prompt = [5] * (context - 6)

    def ask(prompt, **extra) -> list[list[int]]:
        fields = {
            "model": MODEL,
            "prompt": prompt,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }
        status, reply = live.post("/v1/completions", json.dumps(fields).encode())
        assert status == 200, reply
        return [c["token_ids"] for c in reply["choices"]]

    (near_end,) = ask(long_prompt)  # no max_tokens: min(64, 6 left) = 6, not an error
    assert len(near_end) == 6
    (short,) = ask("Hello")
    assert len(short) == CAP
    assert len(ask("Hello", max_tokens=500)[0]) == CAP  # the cap bounds max_tokens too
    assert ask([long_prompt, [5, 6, 7]]) == [near_end, ask([5, 6, 7])[0]]  # rows of one request differ
    status, reply = live.post(
        "/v1/completions", json.dumps({"model": MODEL, "prompt": long_prompt, "max_tokens": 7}).encode()
    )
    assert_error(status, reply, 400, "prompt", "context_length_exceeded")  # asked for more than fits


# ----------------------------------------------------------------------------- row 9
@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("temperature", b"Infinity"),
        ("temperature", b"1e-9"),
        ("temperature", b"NaN"),
        ("seed", b"-1"),
        ("seed", b"18446744073709551616"),
        ("top_p", b"NaN"),
        ("top_k", b"-2"),
    ],
)
def test_sampling_errors_name_their_field(live, field, raw):
    data = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "%s": %s}' % (field.encode(), raw)
    assert_error(*live.post("/v1/completions", data), 400, field)


@pytest.mark.skipif(sys.platform == "win32", reason="no open-file limit to manage")
def test_connections_fit_the_open_file_limit(monkeypatch, caplog):
    import resource

    from ssdlocal.server.connections import FD_RESERVE, fit_connections

    limits = {"now": (256, 1024)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    assert fit_connections(128) == 128 and limits["now"] == (256, 1024)  # room already
    assert fit_connections(500) == 500 and limits["now"] == (500 + FD_RESERVE, 1024)  # raised to fit
    limits["now"] = (100, 100)
    with caplog.at_level("WARNING"):
        assert fit_connections(128) == 100 - FD_RESERVE  # cannot be raised: fewer, with a warning
    assert "ulimit -n" in caplog.text
