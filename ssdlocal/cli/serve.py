"""`ssdlocal serve`: options -> socket, EngineConfig, Engine -> the OpenAI-compatible server.

The port is bound before the models load, so a taken port fails at once; loopback is
the default and any other host warns unless --api-key is set. The Host and Origin
allow-lists (--allowed-hosts, --allowed-origins) become an AccessPolicy. The request and
connection limits become a ServerLimits. SIGTERM stops it like Ctrl-C (exit 0 instead
of 130). Wiring only: the server is ssdlocal.server.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from ssdlocal.cli.options import (
    ModelOptions,
    SamplingOptions,
    SpecOptions,
    model_command,
)
from ssdlocal.cli.resolve import engine_config
from ssdlocal.core.errors import UsageError

GRAMMAR_START_S = 120.0  # at most this long for the grammar engine before serving


@model_command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option(help="Require `Authorization: Bearer KEY` on /v1 requests.")] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The model id clients send. Default: the pair's or the target's file name."),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Most rows (requests x n) in one engine batch.")] = 8,
    max_request_rows: Annotated[
        int,
        typer.Option(
            help="Most completions (prompts x n) one request may ask for; more: 400. "
            "A request runs in engine batches of at most --max-batch rows."
        ),
    ] = 64,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body in MiB; larger: 413, unread.")] = 8.0,
    max_prompt_chars: Annotated[
        int | None,
        typer.Option(
            help="Most prompt characters per request, checked before tokenizing; "
            "more: 400. Default: 32 per token of the model's context, at most 1,000,000."
        ),
    ] = None,
    max_connections: Annotated[
        int, typer.Option(help="Most open connections; one more is answered 503 and closed.")
    ] = 128,
    header_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds for a request's headers to arrive (from connecting or the "
            "previous answer); then the connection is closed."
        ),
    ] = 10.0,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds for a request's body to arrive once its headers did; then 408.")
    ] = 30.0,
    idle_timeout: Annotated[
        float, typer.Option(help="Seconds a kept-alive connection may idle between requests.")
    ] = 5.0,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option(
            help="Another name the server answers to in the Host header "
            "(repeatable or comma-separated; NAME:PORT for one port; '*' any). "
            "Always: localhost, 127.0.0.1, [::1] and --host."
        ),
    ] = None,
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            help="A web page origin (scheme://host[:port]) allowed to call the "
            "server from a browser, with CORS (repeatable or comma-separated; "
            "'*' any page). Default: none."
        ),
    ] = None,
    *,  # the shared options come after the server's own
    models: ModelOptions,
    spec: SpecOptions,
    sampling: SamplingOptions,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"port must be in 0..65535, got {port}", "use e.g. --port 8000")
    if max_batch < 1:
        raise UsageError(f"max-batch must be >= 1, got {max_batch}", "use e.g. --max-batch 8")
    if api_key is not None and not api_key.strip():
        raise UsageError("the API key is empty", "pass a non-empty --api-key or drop it")
    sampling.params()  # validates --max-new-tokens
    _require_server_libraries()
    from ssdlocal.server.gate import AccessPolicy
    from ssdlocal.server.limits import MiB, ServerLimits
    from ssdlocal.server.run import bind, sigterm_exits

    if not 0 < max_body_mb < 1 << 20:  # NaN and inf fail too
        raise UsageError(f"max-body-mb must be positive (MiB), got {max_body_mb}", "use e.g. --max-body-mb 8")
    access = AccessPolicy(host=host, extra_hosts=_entries(allowed_hosts), extra_origins=_entries(allowed_origins))
    limits = ServerLimits(
        max_body_bytes=max(1, round(max_body_mb * MiB)),
        max_prompt_chars=max_prompt_chars,
        max_request_rows=max_request_rows,
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        idle_timeout_s=idle_timeout,
    )
    with sigterm_exits():
        sock = bind(host, port)  # before the models load: a taken port fails at once
        access = replace(access, port=sock.getsockname()[1])
        try:
            config = engine_config(models, spec)
            name = served_model_name or _model_name(models.target, models.pair, config.target.path)
            _serve(
                sock,
                config,
                name,
                api_key=api_key,
                max_batch=max_batch,
                max_new_tokens=sampling.max_new_tokens,
                limits=limits,
                access=access,
            )
        finally:
            sock.close()


def _entries(values: list[str] | None) -> tuple[str, ...]:
    """Repeated and comma-separated option values, one tuple."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


def _require_server_libraries() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError(
            "the server needs Starlette and uvicorn", "install them with: pip install 'ssdlocal[serve]'"
        ) from None


def _model_name(target: str | None, pair: str | None, path: str) -> str:
    """The id clients send: the pair's name, the default model's, or the target's file name."""
    if target is None and pair is not None:
        return Path(pair).name.removesuffix(".toml")
    if target is None:
        from ssdlocal.weights.assets import DEFAULT_TARGET

        return DEFAULT_TARGET
    return Path(path).name.removesuffix(".gguf") or path


def _serve(sock, config, name: str, *, api_key, max_batch: int, max_new_tokens, limits, access) -> None:
    from ssdlocal import __version__
    from rich.markup import escape

    from ssdlocal.cli.render import err_console, load_engine, weights_line
    from ssdlocal.server.app import ServerState, create_app
    from ssdlocal.server.connections import fit_connections
    from ssdlocal.server.metrics import ServerMetrics
    from ssdlocal.server.run import is_loopback, make_server, url
    from ssdlocal.server.scheduler import Scheduler

    if not is_loopback(sock) and api_key is None:
        err_console.print(
            f"warning: listening on {url(sock)} without --api-key: anyone who can reach this machine can use the model",
            style="yellow",
            soft_wrap=True,
        )
    engine = load_engine(config)  # progress on stderr
    with engine:
        mode = engine.choice.mode.value  # what --mode auto resolved to, as requests report it
        metrics = ServerMetrics(name, mode, __version__)
        scheduler = Scheduler(engine, metrics, mode=mode, max_batch=max_batch)
        limits = replace(limits, max_connections=fit_connections(limits.max_connections))
        state = ServerState(
            scheduler,
            metrics,
            name,
            engine.context,
            engine.tokenizer,
            api_key=api_key,
            max_new_tokens=max_new_tokens,
            vocab_size=engine.target.args.vocab_size,
            limits=limits,
            access=access,
        )
        server = make_server(
            create_app(state),
            limits=limits,
            on_shutdown=state.begin_shutdown,
            verbose=logging.getLogger().isEnabledFor(logging.DEBUG),
        )
        scheduler.start()
        # the grammar engine's start-up (its vocabulary view, the compile children) would
        # take CPU from the first prompt read: requests are accepted once it is done
        state.grammars.wait_ready(GRAMMAR_START_S)
        err_console.print(
            f"serving [bold]{name}[/bold] at {url(sock)}/v1 · metrics at {url(sock)}/metrics · "
            f"Ctrl-C stops\n{escape(weights_line(config))}\n{escape(engine.choice.line)}",
            soft_wrap=True,
            highlight=False,
        )
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.stop()
