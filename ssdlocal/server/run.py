"""Listening and serving: bind the socket first (a taken port fails fast, before the
model loads), then run uvicorn on it until Ctrl-C or SIGTERM, then stop the engine thread.

uvicorn runs our h11 protocol (connections.py: connection limit, head deadline) with the
idle timeout as its keep-alive; its shutdown first tells the app (`on_shutdown`), so
answers in flight end with an error event at once instead of being cut after a wait.
Loopback is the default; `is_loopback` lets the CLI warn before anything else listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator

from ssdlocal.core.errors import SSDLocalError
from ssdlocal.server.limits import ServerLimits

log = logging.getLogger(__name__)
BACKLOG = 128  # connections waiting to be accepted
GRACE_S = 3  # at shutdown, how long a response that cannot end (a stalled reader) may take


class ServerError(SSDLocalError):
    """The server cannot listen or start."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServerError(f"cannot resolve host {host!r}: {exc.strerror}", "use an address such as 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not past a listener: only TIME_WAIT
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise _bind_error(exc, host, port) from None
    sock.set_inheritable(True)
    return sock


def _bind_error(exc: OSError, host: str, port: int) -> ServerError:
    if exc.errno == errno.EADDRINUSE:
        return ServerError(
            f"port {port} on {host} is already in use",
            f"stop the program listening there (e.g. `lsof -i :{port}`) or pick another port: --port {port + 1}",
        )
    if exc.errno == errno.EACCES:
        return ServerError(f"no permission to listen on {host}:{port}", "use a port above 1023, e.g. --port 8000")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ServerError(f"{host} is not an address of this machine", "use 127.0.0.1 (this machine only) or 0.0.0.0")
    return ServerError(f"cannot listen on {host}:{port}: {exc.strerror}", "try another --host or --port")


def is_loopback(sock: socket.socket) -> bool:
    address = sock.getsockname()[0]
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def make_server(
    app,
    *,
    limits: ServerLimits | None = None,
    on_shutdown: Callable[[], None] | None = None,
    verbose: bool = False,
):
    """A uvicorn Server for `app` (run it with `.run(sockets=[sock])`); `on_shutdown` is
    called when it starts stopping, before it waits for open connections."""
    import uvicorn

    from ssdlocal.server.connections import protocol_class, quiet_accept_errors

    limits = limits or ServerLimits()
    config = uvicorn.Config(
        app,
        http=protocol_class(limits),
        log_level="info" if verbose else "warning",
        access_log=verbose,
        lifespan="off",
        backlog=BACKLOG,
        timeout_keep_alive=limits.idle_timeout_s,
        timeout_graceful_shutdown=GRACE_S,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None) -> None:
            if on_shutdown is not None:
                on_shutdown()  # no await before uvicorn marks the connections to close
            await super().shutdown(sockets=sockets)

    return Server(config)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside: SIGTERM raises SystemExit(0) in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so `finally` blocks stop the engine and its worker processes;
    further SIGTERMs during that clean-up are ignored. (While uvicorn runs it takes the
    signal itself, shuts down gracefully, and then raises it again here.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
