"""Listening and serving: bind the socket first (a taken port fails fast, before the
model loads), then run uvicorn on it until Ctrl-C, then stop the engine thread.

Loopback is the default; `is_loopback` lets the CLI warn before anything else listens.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket

from ssdlocal.core.errors import SSDLocalError

log = logging.getLogger(__name__)


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
        sock.listen(128)
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


def make_server(app, *, verbose: bool = False):
    """A uvicorn Server for `app` (run it with `.run(sockets=[sock])`)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        lifespan="off",
        timeout_graceful_shutdown=3,  # streams still open at Ctrl-C are cancelled after this
    )
    return uvicorn.Server(config)
