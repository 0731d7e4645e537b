"""The `ssdlocal serve` command: a taken port is refused with error + hint before any
model loads, a non-loopback host warns without --api-key, --api-key is enforced, and
the real command (a subprocess) serves a request and stops cleanly on Ctrl-C.

Everything listens on 127.0.0.1 only, on free ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent


def test_a_taken_port_is_refused_before_models_load(monkeypatch, capsys, tiny_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    loads = []
    monkeypatch.setattr("ssdlocal.cli.serve.engine_config", lambda *a, **k: loads.append(1))
    try:
        code, _, err = run_cli(
            monkeypatch, capsys, "serve", "--target", tiny_dir["llama"], "--mode", "ar", "--port", port
        )
    finally:
        taken.close()
    assert_clean_error(code, err, 1, f"port {port} on 127.0.0.1 is already in use", f"--port {port + 1}")
    assert not loads


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "port must be in 0..65535"),
        (["--max-batch", "0"], "max-batch must be >= 1"),
        (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--api-key", " "], "the API key is empty"),
        (["--max-body-mb", "0"], "max-body-mb must be positive"),
        (["--max-body-mb", "inf"], "max-body-mb must be positive"),
        (["--max-request-rows", "0"], "max-request-rows must be positive"),
        (["--max-connections", "0"], "max-connections must be positive"),
        (["--max-prompt-chars", "0"], "max-prompt-chars must be >= 1"),
        (["--header-timeout", "0"], "header-timeout must be a positive number of seconds"),
        (["--body-timeout", "inf"], "body-timeout must be a positive number of seconds"),
        (["--idle-timeout", "-1"], "idle-timeout must be a positive number of seconds"),
        (["--allowed-origins", "localhost:3000"], "is not an origin"),
        (["--allowed-hosts", "my box"], "is not a host name"),
    ],
)
def test_bad_serve_options_are_usage_errors(monkeypatch, capsys, tiny_dir, args, needle):
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--target", tiny_dir["llama"], "--mode", "ar", *args)
    assert_clean_error(code, err, 2, needle)


def test_every_server_limit_is_an_option_documented_in_help_and_readme(monkeypatch, capsys):
    """Each limit has a `serve` option with a default and help text shown by --help, and
    a row in the limits table of docs/hardening.md (where the README's Serving section sends it)."""
    import typer

    from ssdlocal.cli.app import app

    params = {p.opts[0]: p for p in typer.main.get_command(app).commands["serve"].params if p.opts}
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(monkeypatch, capsys, "serve", "--help")
    assert code == 0
    hardening = (ROOT / "docs" / "hardening.md").read_text()
    serving = hardening[hardening.index("## Limits") : hardening.index("## Malformed requests")]
    for option, default in [
        ("--max-body-mb", 8.0),
        ("--max-prompt-chars", None),
        ("--max-request-rows", 64),
        ("--max-batch", 8),
        ("--max-connections", 128),
        ("--header-timeout", 10.0),
        ("--body-timeout", 30.0),
        ("--idle-timeout", 5.0),
    ]:
        assert params[option].default == default and params[option].help, option
        assert option in out, option
        assert f"| `{option}` ({default if default is not None else ''}" in serving, option
    assert "32 per token" in params["--max-prompt-chars"].help
    from ssdlocal.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert f"`stop`: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters" in serving


@pytest.mark.parametrize("api_key", [None, "secret"])
def test_a_non_loopback_host_warns_without_an_api_key(monkeypatch, capsys, tmp_path, api_key):
    """The warning comes before the models load (here: a missing target ends the run);
    the socket itself stays on loopback, only its loopback check is faked."""
    monkeypatch.setattr("ssdlocal.server.run.is_loopback", lambda sock: False)
    extra = ["--api-key", api_key] if api_key else []
    code, _, err = run_cli(
        monkeypatch, capsys, "serve", "--target", tmp_path / "missing", "--mode", "ar", "--port", "0", *extra
    )
    assert code != 0 and "Traceback" not in err
    warned = "without --api-key" in err
    assert warned == (api_key is None), err


def test_api_key_is_required_when_set(tiny_dir):
    from support.server import MODEL, LiveServer

    from ssdlocal.core.config import EngineConfig, ModelSpec

    live = LiveServer(EngineConfig(target=ModelSpec(str(tiny_dir["small_llama"]), dtype="float32")), api_key="s3cret")
    try:
        body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
        status, reply = live.post("/v1/completions", body)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        status, reply = live.post("/v1/completions", body, {"Authorization": "Bearer wrong"})
        assert status == 401
        status, reply = live.post("/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2
        assert live.client.models.list().data[0].id == MODEL  # the client sends the key
    finally:
        live.close()


def test_serve_command_answers_and_stops_on_ctrl_c(tiny_dir):
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
            "sd",
            "--draft",
            "ngram",
            "--dtype",
            "float32",
            "--port",
            "0",
            "--served-model-name",
            "tiny-llama",
            "--allowed-origins",
            "http://localhost:3000",
            "--allowed-hosts",
            "my-box.lan",
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
                url = line.split(" at ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        assert url and url.startswith("http://127.0.0.1:"), url
        # the weights' real format and the mode line every command prints (placement/mode.py)
        weights, mode = proc.stderr.readline().strip(), proc.stderr.readline().strip()
        assert weights == f"weights: target fp32 from {tiny_dir['llama'].name}", weights
        assert mode == "mode sd: --mode sd was asked for", mode
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        req = urllib.request.Request(
            f"{url}/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {"model": "tiny-llama", "prompt": "Hello world", "max_tokens": 5, "temperature": 0}
            ).encode(),
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            reply = json.loads(resp.read())
        assert reply["usage"]["completion_tokens"] == 5 and reply["ssdlocal"]["mode"] == "sd"
        for headers, status in [
            ({"Origin": "https://evil.example"}, 403),
            ({"Host": "attacker.example"}, 403),
            ({"Content-Type": "text/plain"}, 415),
            ({"Host": "my-box.lan"}, 200),
            ({"Origin": "http://localhost:3000"}, 200),
        ]:
            req = urllib.request.Request(
                f"{url}/completions",
                method="POST",
                data=req.data,
                headers={"Content-Type": "application/json", **headers},
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    got, allow = resp.status, resp.headers.get("Access-Control-Allow-Origin")
            except urllib.error.HTTPError as exc:
                got, allow = exc.code, exc.headers.get("Access-Control-Allow-Origin")
            assert got == status, headers
            assert allow == headers.get("Origin") if status == 200 else allow is None, headers
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err
        assert proc.returncode in (0, 130), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("command", ["serve", "chat"])  # race runs every mode: no --mode
def test_model_commands_take_generates_model_and_speculation_options_and_defaults(command):
    """Every command that runs a model accepts the options `generate` does for the model,
    devices, backends, weights and speculation, with the same defaults (e.g. --mode auto)."""
    import dataclasses
    import inspect

    from ssdlocal.cli import serve, tui
    from ssdlocal.cli.generate import generate
    from ssdlocal.cli.resolve import ModelOptions, SpecOptions

    func = {"serve": serve.serve, "chat": tui.chat}[command]
    ours, theirs = inspect.signature(generate).parameters, inspect.signature(func).parameters
    shared = {f.name for cls in (ModelOptions, SpecOptions) for f in dataclasses.fields(cls)} & set(ours)
    missing = "absent"
    assert len(shared) > 10
    assert {n: theirs[n].default if n in theirs else missing for n in shared} == {n: ours[n].default for n in shared}
