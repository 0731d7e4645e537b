"""`ssdlocal cache`: what the cache holds, with sizes; `ssdlocal cache remove WHAT`.

Wiring and rendering only: the entries and their safe removal are ssdlocal.weights.cache.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from ssdlocal.cli.help import PlainCommand, PlainGroup
from ssdlocal.core.errors import UsageError

cache_app = typer.Typer(
    cls=PlainGroup,
    rich_markup_mode=None,
    invoke_without_command=True,
    no_args_is_help=False,
    help="What the cache holds (sizes, what each entry is for); `cache remove` deletes entries.",
)
out = Console(soft_wrap=False)


def _human(size: int) -> str:
    from rich.filesize import decimal

    return decimal(size)


@cache_app.callback()
def cache(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the cache: each entry's kind, size and name, and the total."""
    if ctx.invoked_subcommand is not None:
        return
    from ssdlocal.core.paths import cache_dir
    from ssdlocal.weights.cache import entries, total_size

    found = entries()
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    "root": str(cache_dir()),
                    "total_bytes": total_size(found),
                    "entries": [
                        {"kind": e.kind, "name": e.name, "bytes": e.size, "path": str(e.path), "what": e.what}
                        for e in found
                    ],
                }
            )
            + "\n"
        )
        return
    out.print(
        f"cache {cache_dir()}: {_human(total_size(found))} in {len(found)} entries", highlight=False, soft_wrap=True
    )
    for kind in dict.fromkeys(e.kind for e in found):  # one section per kind: names fit 80 columns
        mine = [e for e in found if e.kind == kind]
        out.print(
            f"\n[bold]{kind}[/bold] ({_human(total_size(mine))}): {mine[0].what}", highlight=False, soft_wrap=True
        )
        for e in mine:
            out.print(
                f"{_human(e.size):>10}  {e.path.name if kind != 'index' else e.name}", highlight=False, soft_wrap=True
            )
    out.print(
        "\n[dim]remove with `ssdlocal cache remove NAME|KIND`; the next run that needs an "
        "entry builds or fetches it again[/dim]",
        highlight=False,
    )


@cache_app.command(cls=PlainCommand)
def remove(
    what: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="NAME|KIND",
            help="Entries by name (as `ssdlocal cache` lists them, or "
            "its last part, or a unique prefix) or a whole kind: converted, quantized, ...",
        ),
    ] = None,
    remove_all: Annotated[bool, typer.Option("--all", help="Everything in the cache.")] = False,
) -> None:
    """Delete cache entries (refused while another process builds one)."""
    from ssdlocal.weights.cache import entries, remove as remove_entry, select, total_size

    found = entries()
    if remove_all and what:
        raise UsageError("--all takes no names", "use either --all or names")
    if not remove_all and not what:
        raise UsageError("nothing to remove", "name entries or kinds (see `ssdlocal cache`), or pass --all")
    chosen = found if remove_all else select(found, list(what or ()))
    for entry in chosen:
        remove_entry(entry)
        out.print(f"removed {entry.name} ({_human(entry.size)})", highlight=False, soft_wrap=True)
    out.print(f"freed {_human(total_size(chosen))}", highlight=False)
