"""User settings: the config directory, `config.toml`, and SSDLOCAL_<OPTION> variables.

Precedence for a command option: command line > environment > config file > built-in
default. Environment variables cover `generate` (`SSDLOCAL_MAX_NEW_TOKENS=64`); the
config file has one table per command (`[generate]`, `[check]`, ...) keyed by option
name (`max_new_tokens` or `max-new-tokens`). Both become a Click `default_map`, so
Click converts and validates the values exactly as it does for flags.
Knows nothing about models; only the standard library is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

from ssdlocal.core.errors import UsageError
from ssdlocal.core.files import kind_of
from ssdlocal.core.paths import config_file

ENV_PREFIX = "SSDLOCAL_"
MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few lines
ENV_COMMANDS = ("generate",)  # commands whose options read SSDLOCAL_<OPTION>


def load_config(path: Path | None = None) -> dict:
    """The parsed config file ({} when there is none). Unreadable or invalid -> UsageError."""
    path = config_file() if path is None else path
    if not path.exists():
        return {}
    if (kind := kind_of(path)) is not None:  # a FIFO would block the read forever
        raise UsageError(
            f"config file {path} is {kind}, not a file",
            f"replace {path} with a TOML file, or set SSDLOCAL_CONFIG_DIR to another folder",
        )
    try:
        with open(path, "rb") as fh:
            data = tomllib.loads(fh.read(MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        what = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"not valid TOML: {str(exc)[:200]}"
        raise UsageError(
            f"config file {path} is {what}",
            f"fix {path} (it holds tables like [generate] with option = value)",
        ) from None
    except OSError as exc:
        raise UsageError(
            f"cannot read config file {path}: {exc.strerror or exc}",
            f"check the permissions of {path}, or set SSDLOCAL_CONFIG_DIR to another folder",
        ) from None
    for table, values in data.items():
        if not isinstance(values, dict):
            raise UsageError(
                f"config file {path}: `{table}` must be a table like [generate], got {type(values).__name__}",
                f"put options under a command table in {path}, e.g. [generate] then k = 4",
            )
    return data


def _env_name(param) -> str:
    """SSDLOCAL_<OPTION> from the option's long flag: --max-new-tokens -> SSDLOCAL_MAX_NEW_TOKENS."""
    flags = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
    name = flags[0][2:] if flags else param.name
    return ENV_PREFIX + name.replace("-", "_").upper()


def _options(command) -> dict[str, object]:
    """name -> Click option of `command` (arguments are left out: they have no defaults)."""
    return {p.name: p for p in command.params if getattr(p, "param_type_name", "") == "option"}


def env_values(command_name: str, command, environ=None, ctx=None) -> dict[str, object]:
    """Option values found in SSDLOCAL_<OPTION> variables for `command`."""
    environ = os.environ if environ is None else environ
    found: dict[str, object] = {}
    if command_name not in ENV_COMMANDS:
        return found
    for name, param in _options(command).items():
        value = environ.get(_env_name(param))
        if value is None or value == "":
            continue
        value = value.split() if getattr(param, "multiple", False) else value
        env = _env_name(param)
        found[name] = _checked(param, value, f"environment variable {env}", f"fix or unset {env}", ctx)
    return found


def _checked(param, value, where: str, hint: str, ctx=None):
    """`value` converted as the option itself would; a UsageError naming `where` if it fails.

    Plain Click options convert through `param.type`; Typer's own options (typer >= 0.2x)
    through `process_value` with a context for the subcommand. Without either, unchanged.
    """
    try:
        if hasattr(param, "type"):
            items = value if isinstance(value, list) else [value]
            converted = [param.type.convert(v, param, ctx) for v in items]
            return converted if isinstance(value, list) else converted[0]
        if ctx is not None:
            return param.process_value(ctx, value)
    except Exception as exc:  # noqa: BLE001 - Click's BadParameter (vendored or not) and friends
        text = getattr(exc, "message", None) or str(exc)
        raise UsageError(
            f"{where}: invalid value {value!r} for --{param.name.replace('_', '-')}: {text}", hint
        ) from None
    return value


def default_map(group, path: Path | None = None, environ=None, ctx=None) -> dict[str, dict]:
    """Click default_map for every subcommand of `group`: config file, then env on top.

    With `ctx` (the group's context) every value is converted and checked up front, so a
    bad one is reported with the file or variable it came from.
    """
    path = config_file() if path is None else path
    data = load_config(path)
    commands = getattr(group, "commands", {})
    unknown = sorted(set(data) - set(commands))
    if unknown:
        raise UsageError(
            f"config file {path} has a table for unknown command(s): {', '.join(unknown)}",
            f"use tables named after commands: {', '.join(sorted(commands))}",
        )
    result: dict[str, dict] = {}
    for name, command in commands.items():
        options = _options(command)
        sub_ctx = type(ctx)(command, parent=ctx, info_name=name) if ctx is not None else None
        values: dict[str, object] = {}
        for key, value in data.get(name, {}).items():
            option = key.replace("-", "_")
            option = {"json": "as_json"}.get(option, option) if option not in options else option
            if option not in options:
                raise UsageError(
                    f"config file {path}: [{name}] has unknown option {key!r}",
                    f"options of `ssdlocal {name}`: " + ", ".join(sorted(o.replace("_", "-") for o in options)),
                )
            values[option] = _checked(
                options[option],
                value,
                f"config file {path}: [{name}]",
                f"fix `{key}` in {path}",
                sub_ctx,
            )
        values.update(env_values(name, command, environ, sub_ctx))
        if values:
            result[name] = values
    return result


def apply_defaults(ctx) -> None:
    """Install the default_map on the root Click context (call from the app callback)."""
    found = default_map(ctx.command, ctx=ctx)
    if found:
        merged = dict(ctx.default_map or {})
        for name, values in found.items():
            merged[name] = {**values, **(merged.get(name) or {})}
        ctx.default_map = merged
