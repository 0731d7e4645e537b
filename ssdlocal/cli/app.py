"""The Typer app: the root options, command registration, and the error edge.

Commands live in their own modules and only wire options to one library call. Domain
errors (SSDLocalError) become `error: ... / hint: ...` on stderr and exit code 1 (2 for
usage errors); Ctrl-C exits 130. No traceback reaches the user unless --verbose is given.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from ssdlocal import __version__
from ssdlocal.core.errors import SSDLocalError

from ssdlocal.cli.help import PlainCommand, PlainGroup  # noqa: E402 - plain 80-column help

app = typer.Typer(
    name="ssdlocal",
    help="Fastest exact local LLM generation with Speculative Speculative Decoding (SSD).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=PlainGroup,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ssdlocal {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log details to stderr.")] = False,
) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr)
    _STATE["verbose"] = verbose
    from ssdlocal.cli.settings import apply_defaults

    apply_defaults(ctx)  # config.toml tables and SSDLOCAL_<OPTION> variables become defaults


_STATE: dict[str, bool] = {"verbose": False}


def _register() -> None:
    """Attach every command (each module imports only what its command needs)."""
    from ssdlocal.cli import bench, cache, check, export, generate, models, pull, serve, tui

    for command in (
        generate.generate,
        bench.bench,
        tui.chat,
        tui.race,
        serve.serve,
        models.pairs,
        pull.pull,
        pull.rm,
        models.devices,
        check.check,
        export.export,
    ):
        app.command(cls=PlainCommand)(command)
    app.add_typer(cache.cache_app, name="cache")


_register()


def main() -> None:
    """Console entry point: run the app, mapping every failure to a clean exit.

    SSDLocalError -> `error:` / `hint:` lines and its exit code (2 usage, 1 runtime);
    Click's own usage errors -> the same two lines and exit 2; Ctrl-C -> exit 130.
    Typer returns (not raises) exit codes in non-standalone mode, so the return value
    of `app(...)` is the exit status; 130 there means Ctrl-C was turned into Exit(130).
    """
    try:
        code = app(standalone_mode=False)
    except SSDLocalError as exc:
        _log_traceback()
        _fail(exc.message, exc.hint, exc.exit_code)
    except KeyboardInterrupt:
        _interrupted()
    except BrokenPipeError:  # `ssdlocal generate ... | head`: the reader left
        _silence_stdout()
        raise SystemExit(1) from None
    except Exception as exc:  # noqa: BLE001 - the CLI edge: nothing escapes as a traceback
        _fail_unexpected(exc)
    if isinstance(code, int) and code == 130:
        _interrupted()
    raise SystemExit(code if isinstance(code, int) else 0)


def _fail(message: str, hint: str, exit_code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise SystemExit(exit_code) from None


def _interrupted() -> None:
    typer.echo("\ninterrupted", err=True)
    raise SystemExit(130) from None


def _log_traceback() -> None:
    if _STATE["verbose"]:
        logging.getLogger("ssdlocal").exception("failed")


def _silence_stdout() -> None:
    import os

    try:  # further writes (and the interpreter's final flush) must not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _click_error_types() -> tuple[type, ...]:
    """ClickException from Typer's vendored Click (typer >= 0.20) and from click itself."""
    import importlib

    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _fail_unexpected(exc: Exception) -> None:
    if type(exc).__name__ == "Abort" and isinstance(exc.__cause__, KeyboardInterrupt):
        _interrupted()
    if type(exc).__name__ == "Abort":
        _fail("aborted", "", 1)
    if isinstance(exc, _click_error_types()):
        if type(exc).__name__ == "NoArgsIsHelpError":  # the message is the (plain) help
            typer.echo(exc.format_message())
            raise SystemExit(exc.exit_code) from None
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "ssdlocal"
        _fail(exc.format_message(), f"run `{where} --help` for usage", exc.exit_code)
    from ssdlocal.core.memory import oom_error

    oom = oom_error(exc)
    if oom is not None:  # torch's CUDA error or the CPU allocator's, wherever it surfaced
        _log_traceback()
        _fail(oom.message, oom.hint, 1)
    if _STATE["verbose"]:
        raise exc
    _fail(
        f"unexpected {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "),
        "this is a bug; rerun with --verbose for the traceback and report it",
        1,
    )
