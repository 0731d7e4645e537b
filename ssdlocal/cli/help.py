"""`--help` as plain text that reads the same on an 80-column terminal and in a pipe.

Typer's Rich help boxes squeeze descriptions beside a wide option column at 80 columns and
cut long option names; its plain help shows types as `<str>` / `<list[str]>` and required
arguments as `{prompts}...`. These command classes keep Click's plain layout (options in
a column of at most 30 characters, descriptions wrapped beside or below) and name values
the way Click does: a metavar (`PATH`, `N`) or the type in capitals (`TEXT`, `INTEGER`).
"""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup


_TYPES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN"}


def value_name(param, ctx=None) -> str:
    """What an option's value or an argument is called in help: its metavar, else its
    type in capitals (`TEXT`, `INTEGER`, `FLOAT`, `PATH`), or its choices (`a|b`)."""
    if param.metavar:
        return param.metavar
    if param.param_type_name == "argument":
        return (param.name or "value").upper()
    try:
        shown = param.display_type(ctx).strip("<>")  # typer: "<int>", "<list[str]>", "<a|b>"
    except (AttributeError, TypeError):
        return "VALUE"
    shown = shown.removeprefix("list[").removesuffix("]")
    return _TYPES.get(shown, "PATH" if "path" in shown.lower() else shown)


def _argument(param) -> str:
    name = value_name(param)
    return f"{name}..." if param.nargs != 1 else name


def _option(param, ctx) -> str:
    takes_value = not (getattr(param, "is_flag", False) or getattr(param, "count", False))
    names = [", ".join(param.opts)]
    if param.secondary_opts:
        names.append(", ".join(param.secondary_opts))
    value = f" {value_name(param, ctx)}" + ("..." if param.nargs != 1 else "") if takes_value else ""
    return " / ".join(n + value for n in names)


def _format_parameters(command, ctx, formatter) -> None:
    args, opts = [], []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            args.append((_argument(param), record[1]))
        else:
            opts.append((_option(param, ctx), record[1]))
    if args:
        with formatter.section("Arguments"):
            formatter.write_dl(args)
    if opts:
        with formatter.section("Options"):
            formatter.write_dl(opts)


def _usage_pieces(command, ctx) -> list[str]:
    pieces = [command.options_metavar] if command.options_metavar else []
    for param in command.get_params(ctx):
        if param.param_type_name == "argument":
            name = _argument(param)
            pieces.append(name if param.required else f"[{name}]")
    return pieces


class _PlainHelp:
    """What PlainCommand and PlainGroup share: no rich markup, plain options and usage."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["rich_markup_mode"] = None
        super().__init__(*args, **kwargs)

    def format_options(self, ctx, formatter) -> None:
        _format_parameters(self, ctx, formatter)

    def collect_usage_pieces(self, ctx) -> list[str]:
        return _usage_pieces(self, ctx)


class PlainCommand(_PlainHelp, TyperCommand):
    """A command whose --help is plain, 80-column text (see the module docstring)."""


class PlainGroup(_PlainHelp, TyperGroup):
    """The root command: plain help, and its commands' one-line summaries."""

    def format_options(self, ctx, formatter) -> None:
        super().format_options(ctx, formatter)
        self.format_commands(ctx, formatter)

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [*super().collect_usage_pieces(ctx), self.subcommand_metavar]
