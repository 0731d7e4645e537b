"""The servers a concurrent benchmark talks to, each a child process on a free loopback port:
`ssdlocal serve` (this interpreter) and llama-cpp-python's own server (`python -m
llama_cpp.server`, with the interpreter the user names).

`ServerProcess` is a context manager: it starts the command in its own process group,
polls `GET /v1/models` until the server answers (or the child exits, or time runs out:
SSDLocalError with the log's last lines), and on every way out (an error, Ctrl-C) stops
the whole group: SIGTERM, then SIGKILL after a grace period. No orphans are left behind.
`peer_unavailable` says why the llama.cpp peer cannot run here (None: it can).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import SSDLocalError

HOST = "127.0.0.1"
READY_TIMEOUT_S = 1800.0  # a first `ssdlocal serve` on a slow CPU calibrates for minutes
STOP_GRACE_S = 15.0
# what llama-cpp-python's server imports: the package and its [server] extras
PEER_IMPORTS = "import llama_cpp, llama_cpp.server.app"


@dataclass(frozen=True)
class ServerSpec:
    """A server to start: its name in the report, its command (without host/port) and how
    the host and port are passed to it."""

    name: str
    argv: tuple[str, ...]
    host_flag: str = "--host"
    port_flag: str = "--port"
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ssdlocal_server(name: str, model_args: tuple[str, ...], served_name: str) -> ServerSpec:
    """`ssdlocal serve` with this interpreter and the bench's model/speculation flags."""
    argv = (sys.executable, "-m", "ssdlocal", "serve", "--served-model-name", served_name, *model_args)
    return ServerSpec(name, argv)


def llamacpp_server(name: str, python: str, gguf: str, served_name: str, threads: int, n_ctx: int) -> ServerSpec:
    """llama-cpp-python's OpenAI-compatible server on `gguf` with `threads` threads. It runs
    one request at a time; by default a new request ends the streaming one early
    (`interrupt_requests`), which would cut answers short: here they wait their turn."""
    argv = (
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        served_name,
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
    )
    return ServerSpec(name, argv)


def peer_unavailable(python: str, gguf: str | None) -> str | None:
    """Why llama-cpp-python's server cannot run with `python` on `gguf` (None: it can)."""
    if not gguf:
        return "skipped: no GGUF target (pass --gguf-target, or a pair/target that comes from a GGUF)"
    if not Path(gguf).is_file():
        return f"skipped: GGUF target not found: {gguf}"
    try:
        done = subprocess.run([python, "-c", PEER_IMPORTS], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"skipped: cannot run {python} ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"skipped: llama-cpp-python's server is not importable by {python} ({last}); install "
            "'llama-cpp-python[server]' there or pass --peer-python"
        )
    return None


class ServerProcess:
    """One running server: `with ServerProcess(spec, log_path) as server:` starts it and waits
    until it answers; `server.port`, `server.pid`; leaving the block stops it."""

    def __init__(self, spec: ServerSpec, log_path: Path, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.spec, self.log_path, self.ready_timeout_s = spec, log_path, ready_timeout_s
        self.host, self.port = HOST, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> ServerProcess:
        argv = [*self.spec.argv, self.spec.host_flag, self.host, self.spec.port_flag, str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **dict(self.spec.env)},
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SSDLocalError(
                    f"{self.spec.name} exited with code {self.proc.returncode} while starting:\n{self.log_tail()}",
                    f"its whole log: {self.log_path}",
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise SSDLocalError(
                    f"{self.spec.name} did not answer GET /v1/models within "
                    f"{self.ready_timeout_s:.0f} s:\n{self.log_tail()}",
                    f"its log: {self.log_path}",
                )
            time.sleep(0.5)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/v1/models", timeout=5) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server's process group: SIGTERM, SIGKILL after STOP_GRACE_S; wait for it.
        A server that already exited may have left children in its group: they are killed."""
        proc = self.proc
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(STOP_GRACE_S)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(proc.pid)


def _reap_group(pgid: int) -> None:
    """Kill what is left of the group (children the server started and did not stop)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
