"""Stopping `ssdlocal serve` while answers are in flight: streams get a final error
event ("the server is shutting down"), whole answers a 503, at once (no grace-period
wait); the command exits 0 on SIGTERM (130 on Ctrl-C, tests/test_serve_cli.py) without
a traceback, and its SSD draft worker does not outlive it.

In-process: a LiveServer told to exit as uvicorn's signal handler would. Subprocess:
the real command in SSD mode (a draft worker process) and SIGTERM. 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.server import MODEL, LiveServer

openai = pytest.importorskip("openai")

from ssdlocal.core.config import EngineConfig, ModelSpec

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _slow_down(live: LiveServer, monkeypatch, seconds: float) -> None:
    """Each decode step of the target waits `seconds`: answers are surely still running."""
    step = live.engine.runner.step

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    monkeypatch.setattr(live.engine.runner, "step", slow)


def test_answers_in_flight_end_with_an_error_when_the_server_stops(tiny_dir, monkeypatch):
    live = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")))
    try:
        _slow_down(live, monkeypatch, 0.02)
        stream = live.client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)  # the stream is under way
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(
                live.client.completions.create,
                model=MODEL,
                prompt="Hi",
                max_tokens=300,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            time.sleep(0.3)  # that request is waiting or running too
            started = time.perf_counter()
            live.server.should_exit = True  # what uvicorn's SIGINT / SIGTERM handler does
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in chunks:  # the official client raises the final error event
                    pass
            with pytest.raises(openai.InternalServerError) as info:
                whole.result(timeout=30)
        assert info.value.status_code == 503 and info.value.body["code"] == "server_shutting_down"
        assert int(info.value.response.headers["retry-after"]) > 0  # tests/test_server_retry_after.py
        live.thread.join(10)
        assert not live.thread.is_alive()
        assert time.perf_counter() - started < 2  # not uvicorn's 3 s grace period, then cancellation
    finally:
        live.close()


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child processes via /proc (Linux)")
def test_sigterm_during_a_stream_exits_0_quietly_and_leaves_no_worker(tiny_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ssdlocal",
            "serve",
            "--target",
            str(tiny_dir["llama"]),
            "--mode",
            "ssd",
            "--draft",
            str(tiny_dir["draft_llama"]),
            "--k",
            "3",
            "--dtype",
            "float32",
            "--port",
            "0",
            "--served-model-name",
            "tiny",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve exited early"
            if line.startswith("serving "):
                url = line.split(" at ")[1].split()[0]
        assert url, "serve did not start"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="Hello world", temperature=0, stream=True, extra_body={"ignore_eos": True}
        )  # to the end of the context
        chunks = iter(stream)
        next(chunks)
        children = _children(proc.pid)
        # told apart now, while alive: an exiting process's cmdline reads empty
        trackers = {pid for pid in children if _is_resource_tracker(pid)}
        workers = children - trackers
        assert workers, "SSD runs its draft in a worker process"
        proc.send_signal(signal.SIGTERM)
        started = time.perf_counter()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        _, err = proc.communicate(timeout=30)
        assert time.perf_counter() - started < 10
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "CancelledError" not in err, err
        assert not [pid for pid in workers if _alive(pid)]
        # Python's resource tracker (a helper of multiprocessing) leaves on its own once its
        # parent's end of the pipe closes, moments after the parent has exited
        deadline = time.monotonic() + 10
        while [pid for pid in trackers if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in trackers if _alive(pid)]
        json.dumps(err)  # stderr is plain text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
