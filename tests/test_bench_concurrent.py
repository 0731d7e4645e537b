"""`ssdlocal bench --workload concurrent`: clients at once against servers the bench starts.

- a fake llama-cpp-python server (a tiny Starlette app written below, run by the bench as
  `PEER_PYTHON -m llama_cpp.server`) that waits a known time before its first token and
  between tokens: the report's TTFT, total, percentiles and rates come from those timings;
  the agent's tool calls and tool answers, the editor's prompt + suffix and the chat's
  turns reach it; its queue figure is read;
- a tiny `ssdlocal serve` (FIM tokens, a Hermes tool template) beside the fake peer through
  the CLI: every client kind answered, JSON and Markdown written, no server left running;
- a peer that cannot be imported is skipped with a note; a server that dies while
  starting fails with its log; Ctrl-C while clients run stops the server;
- options that do not apply to a workload are refused with `error:` and `hint:`.
"""

from __future__ import annotations

import _thread
import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli
from support.processes import process_gone

from ssdlocal.bench import servers
from ssdlocal.bench.concurrent import ConcurrentSettings, percentile, run_concurrent, summarize
from ssdlocal.bench.report_concurrent import build_concurrent_results, concurrent_markdown
from ssdlocal.bench.stream import RequestTiming, timed_request
from ssdlocal.core.config import SamplingParams

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

FIRST_S = 0.4  # the fake peer's wait before its first token
GAP_S = 0.05  # and between tokens
TOKENS = 6
QUEUE_S = 0.125

FAKE_APP = f"""
import asyncio, json, os
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

LOG = os.environ["FAKE_PEER_LOG"]

async def models(request):
    return JSONResponse({{"object": "list", "data": [{{"id": "bench", "object": "model"}}]}})

def event(obj):
    return "data: " + json.dumps(obj) + "\\n\\n"

async def answer(request):
    body = await request.json()
    with open(LOG, "a") as f:
        f.write(json.dumps({{"path": request.url.path, "body": body}}) + "\\n")
    chat = request.url.path.endswith("chat/completions")
    calls = chat and body.get("tools") and body["messages"][-1]["role"] != "tool"

    async def stream():
        if body.get("cut"):  # what llama-cpp-python does to a request another one interrupts
            yield event({{"choices": [{{"index": 0, "text": "t0 "}}]}})
            yield "data: [DONE]\\n\\n"
            return
        if chat:  # an opening chunk with the role only: not a token
            yield event({{"choices": [{{"index": 0, "delta": {{"role": "assistant"}}}}]}})
        await asyncio.sleep({FIRST_S})
        for i in range({TOKENS}):
            if i:
                await asyncio.sleep({GAP_S})
            if calls:
                part = {{"index": 0, "function": {{"arguments": "x" if i else ""}}}}
                if i == 0:
                    part.update(id="call_7", type="function", function={{"name": "run_tests", "arguments": ""}})
                choice = {{"index": 0, "delta": {{"tool_calls": [part]}}}}
            elif chat:
                choice = {{"index": 0, "delta": {{"content": "w%d " % i}}}}
            else:
                choice = {{"index": 0, "text": "t%d " % i}}
            yield event({{"choices": [choice]}})
        finish = "tool_calls" if calls else "length"
        key = "delta" if chat else "text"
        yield event({{"choices": [{{"index": 0, key: {{}} if chat else "", "finish_reason": finish}}],
                      "ssdlocal": {{"queue_s": {QUEUE_S}}}}})
        yield "data: [DONE]\\n\\n"

    return StreamingResponse(stream(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", answer, methods=["POST"]),
                       Route("/v1/chat/completions", answer, methods=["POST"])])
"""
FAKE_MAIN = """
import argparse, json, os, sys, uvicorn
from llama_cpp.server.app import app
p = argparse.ArgumentParser()
for flag in ("--model", "--model_alias", "--n_threads", "--n_threads_batch", "--n_ctx", "--interrupt_requests",
             "--host", "--port"):
    p.add_argument(flag)
args = p.parse_args()
with open(os.environ["FAKE_PEER_LOG"], "a") as f:
    f.write(json.dumps({"args": vars(args)}) + "\\n")
if "crash" in args.model:
    print("fake peer: cannot load " + args.model, flush=True)
    sys.exit(3)
uvicorn.run(app, host=args.host, port=int(args.port), log_level="warning")
"""


def _python_with(root: Path, files: dict[str, str]) -> str:
    """A `python` that sees `files` (a fake llama_cpp package) first on its path."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    exe = root / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{root}" exec "{sys.executable}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    """(peer python, request log, GGUF path): the bench's llamacpp peer is the fake app."""
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    python = _python_with(
        tmp_path / "peer",
        {
            "llama_cpp/__init__.py": "",
            "llama_cpp/server/__init__.py": "",
            "llama_cpp/server/app.py": FAKE_APP,
            "llama_cpp/server/__main__.py": FAKE_MAIN,
        },
    )
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return python, log, gguf


@pytest.fixture
def started(monkeypatch):
    """Every server process the bench starts (to check that none outlives it); the short
    import check run before a peer is not one."""
    procs = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        if kwargs.get("start_new_session"):  # servers run in a group of their own
            procs.append(proc)
        return proc

    monkeypatch.setattr(servers.subprocess, "Popen", popen)
    return procs


def _peer_only(python: str, gguf: Path, **kw) -> ConcurrentSettings:
    return ConcurrentSettings(modes=(), peers=("llamacpp",), peer_python=python, gguf_target=str(gguf), **kw)


def test_percentiles_interpolate_between_ranks_and_rates_divide_by_the_span():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    timings = [
        RequestTiming(0, "chat", 0.0, ttft_s=0.5, total_s=2.0, completion_tokens=10),
        RequestTiming(1, "fim", 1.0, ttft_s=1.5, total_s=3.0, completion_tokens=20, queue_s=0.25),
        RequestTiming(2, "agent", 0.5, error="HTTP 500: boom"),
    ]
    s = summarize(timings)
    assert (s["requests"], s["errors"], s["span_s"]) == (3, 1, 4.0)  # first start 0.0, last end 1.0 + 3.0
    assert s["ttft_p50_s"] == 1.0 and s["total_p95_s"] == pytest.approx(2.95)
    assert s["queue_p50_s"] == 0.25 and s["tokens_per_s"] == 30 / 4 and s["requests_per_s"] == 2 / 4


def test_timings_come_from_the_servers_real_delays(fake_peer, started, tmp_path):
    python, log, gguf = fake_peer
    settings = _peer_only(python, gguf, clients=3, requests=2)
    run = run_concurrent(settings, SamplingParams(max_new_tokens=TOKENS), tmp_path / "out")
    (timings,) = run.timings.values()
    assert len(timings) == 6 and not [t.error for t in timings if t.error]
    for t in timings:
        assert t.ttft_s >= FIRST_S  # the role-only chunk before the wait is not the first token
        assert t.total_s >= FIRST_S + (TOKENS - 1) * GAP_S > t.ttft_s
        assert (t.completion_tokens, t.tokens_from, t.queue_s) == (TOKENS, "chunks", QUEUE_S)
    assert sorted(t.kind for t in timings) == ["agent", "agent", "chat", "chat", "fim", "fim"]
    assert [t.tool_calls for t in timings if t.kind == "agent"] == [1, 0]  # a call, then an answer

    doc = build_concurrent_results(run, env={"hardware": {}, "versions": {}})
    agg = doc["aggregates"]["llamacpp-server"]
    assert agg["ttft_p50_s"] == percentile([t.ttft_s for t in timings], 50) >= FIRST_S
    assert agg["total_p95_s"] == percentile([t.total_s for t in timings], 95)
    ends = [t.start_s + t.total_s for t in timings]
    assert agg["span_s"] == pytest.approx(max(ends) - min(t.start_s for t in timings))
    # three clients at once: the span is well under the sum of the requests' times
    assert agg["span_s"] < 0.75 * sum(t.total_s for t in timings)
    assert agg["tokens_per_s"] == pytest.approx(6 * TOKENS / agg["span_s"])
    assert set(doc["by_kind"]["llamacpp-server"]) == {"agent", "fim", "chat"}
    assert [r["system"] for r in doc["requests"]] == ["llamacpp-server"] * 6

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["args"]["interrupt_requests"] == "False"  # requests wait their turn, none is cut off
    sent = [line for line in lines if "path" in line][1:]  # after the warm-up
    agents = [s["body"] for s in sent if s["body"].get("tools")]
    last = agents[1]["messages"][-1]  # the harness's answer to the first step's call
    assert (last["role"], last["tool_call_id"]) == ("tool", "call_7") and last["content"].startswith("FAILED")
    assert agents[1]["messages"][-2]["tool_calls"][0]["function"] == {"name": "run_tests", "arguments": "xxxxx"}
    fims = [s["body"] for s in sent if s["path"] == "/v1/completions"]
    assert all(b["prompt"] and b["suffix"] and b["stream"] for b in fims)
    chats = [s["body"] for s in sent if s["path"].endswith("chat/completions") and not s["body"].get("tools")]
    assert len(chats[1]["messages"]) == 3 and chats[1]["messages"][1]["content"] == "w0 w1 w2 w3 w4 w5 "
    assert started and all(process_gone(p.pid) for p in started)
    assert run.pids["llamacpp-server"] == started[0].pid


def test_ssdlocal_serve_and_the_peer_through_the_cli(fake_peer, started, tmp_path, monkeypatch, capsys):
    from support.tiny_models import make_fim_checkpoint

    model = make_fim_checkpoint(tmp_path / "m", "qwen")
    _tool_template(model)
    python, _, gguf = fake_peer
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        monkeypatch,
        capsys,
        "bench",
        "--workload",
        "concurrent",
        "--target",
        model,
        "--dtype",
        "float32",
        "--no-prefix-cache",
        "--modes",
        "ar",
        "--peers",
        "llamacpp",
        "--peer-python",
        python,
        "--gguf-target",
        gguf,
        "--clients",
        "3",
        "--requests",
        "2",
        "--max-new-tokens",
        "8",
        "--out",
        out,
    )
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["systems"] == ["ssdlocal-ar", "llamacpp-server"] and doc["skipped"] == {}
    ours = [r for r in doc["requests"] if r["system"] == "ssdlocal-ar"]
    assert sorted(r["kind"] for r in ours) == ["agent", "agent", "chat", "chat", "fim", "fim"]
    assert not [r["error"] for r in ours if r["error"]]
    for r in ours:  # ssdlocal reports usage and its own stats on the last chunk
        assert r["tokens_from"] == "usage" and 0 < r["completion_tokens"] <= 8
        assert 0 < r["ttft_s"] <= r["total_s"] and 0 < r["server_ttft_s"] <= r["total_s"]
        assert r["queue_s"] is None or r["queue_s"] >= 0  # read when the server reports one
    agg = doc["aggregates"]["ssdlocal-ar"]
    assert agg["ttft_p50_s"] == pytest.approx(percentile([r["ttft_s"] for r in ours], 50))
    md = (out / "results.md").read_text()
    assert "| ssdlocal-ar | 6 | 0 |" in md and "| llamacpp-server | 6 | 0 |" in md
    assert "ssdlocal-ar" in stdout and "by client" in stdout
    assert (out / "server-ssdlocal-ar.log").is_file()
    assert len(started) == 2 and all(process_gone(p.pid) for p in started)


def _tool_template(model: Path) -> None:
    """Give the tiny checkpoint a Hermes-style tool template (<tool_call> JSON </tool_call>)."""
    (model / "chat_template.jinja").write_text(
        "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}\n"
        'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
        "{%- for m in messages %}{%- if m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}\n"
        '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
        '</tool_call>{%- endfor %}<|im_end|>\n{% elif m.role == "tool" %}<|im_start|>user\n<tool_response>\n'
        "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )  # the template file transformers reads beside tokenizer_config.json
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096  # the tools' JSON takes many of the tiny tokenizer's tokens
    (model / "config.json").write_text(json.dumps(cfg))


def test_no_request_starts_after_the_duration(fake_peer, started, tmp_path):
    python, _, gguf = fake_peer
    settings = _peer_only(python, gguf, clients=2, requests=5, duration_s=FIRST_S / 2)
    run = run_concurrent(settings, SamplingParams(max_new_tokens=2), tmp_path / "out")
    (timings,) = run.timings.values()
    # each answer takes longer than the duration: one request per client, all started at once
    assert sorted(t.kind for t in timings) == ["agent", "fim"] and max(t.start_s for t in timings) < FIRST_S / 2
    assert all(process_gone(p.pid) for p in started)


def test_a_stream_cut_off_before_its_finish_reason_is_a_failed_request(fake_peer, started, tmp_path):
    python, _, gguf = fake_peer
    spec = servers.llamacpp_server("peer", python, str(gguf), "bench", 1, 512)
    with servers.ServerProcess(spec, tmp_path / "peer.log") as server:
        body = {"model": "bench", "prompt": "x", "stream": True}
        whole, _ = timed_request(server.host, server.port, "/v1/completions", body, client=0, kind="fim", t0=0.0)
        cut, reply = timed_request(
            server.host, server.port, "/v1/completions", {**body, "cut": True}, client=0, kind="fim", t0=0.0
        )
    assert whole.error is None and whole.finish_reason == "length"
    assert cut.error == "the stream ended without a finish reason (cut off)" and reply.text == "t0 "
    assert summarize([whole, cut])["errors"] == 1
    assert process_gone(started[0].pid)


def test_a_peer_that_cannot_be_imported_is_skipped_with_a_note(tmp_path, started):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    python = _python_with(tmp_path / "bare", {"llama_cpp/__init__.py": ""})  # no server module
    run = run_concurrent(_peer_only(python, gguf), SamplingParams(max_new_tokens=4), tmp_path / "out")
    (why,) = run.skipped.values()
    assert why.startswith("skipped: llama-cpp-python's server is not importable") and "llama_cpp.server" in why
    assert "--peer-python" in why and run.timings == {} and started == []
    missing = run_concurrent(_peer_only(python, tmp_path / "none.gguf"), SamplingParams(), tmp_path / "out")
    assert missing.skipped == {"llamacpp-server": f"skipped: GGUF target not found: {tmp_path / 'none.gguf'}"}
    doc = build_concurrent_results(
        run,
        env={
            "hardware": {"cpu": "c", "usable_cores": 2, "ram_gib": 1, "gpus": []},
            "versions": {"ssdlocal": "v", "python": "3"},
        },
    )
    assert f"- llamacpp-server: {why}" in concurrent_markdown(doc)


def test_a_server_that_dies_while_starting_fails_with_its_log(fake_peer, started, tmp_path):
    python, _, _ = fake_peer
    crash = tmp_path / "crash.gguf"
    crash.write_bytes(b"GGUF")
    from ssdlocal.core.errors import SSDLocalError

    with pytest.raises(SSDLocalError) as info:
        run_concurrent(_peer_only(python, crash), SamplingParams(max_new_tokens=4), tmp_path / "out")
    assert "exited with code 3 while starting" in info.value.message and "cannot load" in info.value.message
    assert "server-llamacpp-server.log" in info.value.hint
    assert all(process_gone(p.pid) for p in started)


def test_ctrl_c_while_clients_run_stops_the_server(fake_peer, started, tmp_path):
    python, _, gguf = fake_peer

    def progress(stage, done, total, label):  # "clients": called from a client's thread
        if stage == "clients" and done == 1:
            assert not process_gone(started[0].pid)
            _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    with pytest.raises(KeyboardInterrupt):
        run_concurrent(_peer_only(python, gguf), SamplingParams(max_new_tokens=4), tmp_path / "out", progress)
    assert len(started) == 1 and process_gone(started[0].pid)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--workload", "concurrent", "--repeats", "2"], "--repeats does not apply to the concurrent workload"),
        (["--workload", "concurrent", "--clients", "0"], "--clients must be >= 1"),
        (["--workload", "concurrent", "--peers", "hf"], "peer 'hf' has no server"),
        (["--workload", "concurrent", "--modes", "suffix"], "bad --modes 'suffix'"),
        (["--workload", "parallel"], "unknown --workload 'parallel'"),
        (["--clients", "2", "--duration", "5"], "--clients, --duration do not apply to the sequential workload"),
    ],
)
def test_options_that_do_not_fit_the_workload_are_refused(monkeypatch, capsys, started, args, needle):
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--target", "t-dir", *args)
    assert_clean_error(code, err, 2, needle)
    assert started == []


def test_the_serve_flags_reproduce_the_options():
    from ssdlocal.cli.bench import serve_flags
    from ssdlocal.cli.options import ModelOptions, SpecOptions

    models = ModelOptions(pair="p", quantization="int8", prefix_cache=False)
    spec = SpecOptions(mode="ssd", k=5, suffix=False)
    assert serve_flags(models, spec) == (
        "--pair",
        "p",
        "--quantization",
        "int8",
        "--no-prefix-cache",
        "--k",
        "5",
        "--no-suffix",
    )
    assert serve_flags(ModelOptions(), SpecOptions()) == ()
