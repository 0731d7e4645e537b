"""A live `ssdlocal serve` for tests: the real app on uvicorn in a thread, on 127.0.0.1
and a free port, with an OpenAI client pointed at it, stopped by `close()`.

Built from the same pieces as the CLI command (Engine, ServerMetrics, Scheduler, ServerState,
create_app, run.bind / make_server), so only the option parsing is skipped here.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from ssdlocal import __version__
from ssdlocal.core.config import EngineConfig
from ssdlocal.engine import Engine
from ssdlocal.server.app import ServerState, create_app
from ssdlocal.server.gate import AccessPolicy
from ssdlocal.server.limits import ServerLimits
from ssdlocal.server.metrics import ServerMetrics
from ssdlocal.server.run import bind, make_server, url
from ssdlocal.server.scheduler import Scheduler

MODEL = "tiny"


class LiveServer:
    """Engine + scheduler + uvicorn thread; `client` is an openai.OpenAI for it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        api_key: str | None = None,
        max_batch: int = 8,
        limits: ServerLimits | None = None,
        max_new_tokens: int | None = None,
        allowed_hosts: tuple[str, ...] = (),
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        import openai

        self.engine = Engine(config)
        self.mode = config.spec.mode.value
        self.metrics = ServerMetrics(MODEL, self.mode, __version__)
        self.scheduler = Scheduler(self.engine, self.metrics, mode=self.mode, max_batch=max_batch, batch_wait_s=0.05)
        self.limits = limits or ServerLimits()
        self.sock = bind("127.0.0.1", 0)
        self.url = url(self.sock)
        self.port = self.sock.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"  # what a raw request sends as its Host
        access = AccessPolicy("127.0.0.1", self.port, allowed_hosts, allowed_origins)
        self.state = ServerState(
            self.scheduler,
            self.metrics,
            MODEL,
            self.engine.context,
            self.engine.tokenizer,
            api_key=api_key,
            vocab_size=self.engine.target.args.vocab_size,
            limits=self.limits,
            max_new_tokens=max_new_tokens,
            access=access,
        )
        self.server = make_server(create_app(self.state), limits=self.limits, on_shutdown=self.state.begin_shutdown)
        self.scheduler.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.close()
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "unused", max_retries=0, timeout=120)
        self.last_headers: dict[str, str] = {}  # of the last answer to get() / post()

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until every seating begun has ended: an answer can reach the client before
        its seating has stored its prefixes and been counted in the metrics."""
        deadline = time.monotonic() + timeout
        while not self.scheduler.settled:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not settle in {timeout} s")
            time.sleep(0.01)

    def get(self, path: str) -> tuple[int, str]:
        """(status, text); the answer's headers (names lower-cased) in `last_headers`."""
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as resp:
                self.last_headers = {k.lower(): v for k, v in resp.headers.items()}
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            self.last_headers = {k.lower(): v for k, v in exc.headers.items()}
            return exc.code, exc.read().decode()

    def post(self, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                self.last_headers = {k.lower(): v for k, v in resp.headers.items()}
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            self.last_headers = {k.lower(): v for k, v in exc.headers.items()}
            return exc.code, json.loads(exc.read())

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.scheduler.stop()
        if self.state.grammars.pool is not None:  # the grammar compile children (grammar/pool.py)
            self.state.grammars.pool.close()
        self.engine.close()
        self.sock.close()
