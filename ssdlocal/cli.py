"""Typer CLI: wiring only. Each command turns options into configs and calls the library.

Domain errors (SSDLocalError) become `error: ... / hint: ...` on stderr and exit code
1 (2 for usage errors). No traceback reaches the user unless --verbose is given.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from . import __version__
from .config import parse_fan_out
from .errors import SSDLocalError

app = typer.Typer(
    name="ssdlocal",
    help="Fastest exact local LLM generation with Speculative Speculative Decoding (SSD).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    from .settings import apply_defaults

    apply_defaults(ctx)  # config.toml tables and SSDLOCAL_<OPTION> variables become defaults


_STATE: dict[str, bool] = {"verbose": False}


@app.command()
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts (a batch).")],
    target: Annotated[
        str | None,
        typer.Option(help="Target checkpoint dir or .gguf file. Default: the offline Qwen2.5-Coder 1.5B."),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(help="Draft checkpoint dir, .gguf file, or 'ngram'. Default: Qwen2.5-Coder 0.5B."),
    ] = None,
    pair: Annotated[
        str | None,
        typer.Option(help="A registry pair (see `ssdlocal pairs`) instead of --target/--draft."),
    ] = None,
    mode: Annotated[str, typer.Option(help="ar | sd | ssd")] = "ssd",
    k: Annotated[int, typer.Option("--k", help="Draft tokens per round (lookahead K).")] = 4,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option(help="Random seed. AR/SD samples are reproducible; SSD samples too with a fixed --fan-out and --backup other than auto (adaptive schedules follow timing).")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 128,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past end-of-sequence.")] = False,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "bfloat16",
    target_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    draft_device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    target_backend: Annotated[str, typer.Option(help="torch | llamacpp (llamacpp runs a .gguf target through llama.cpp)")] = "torch",
    draft_backend: Annotated[str, typer.Option(help="torch | llamacpp (llamacpp runs a .gguf draft through llama.cpp)")] = "torch",
    target_devices: Annotated[
        str | None,
        typer.Option(help="Tensor-parallel target over these devices, e.g. cuda:0-3 (overrides --target-device); auto = the planner's target and draft devices."),
    ] = None,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = False,
    num_samples: Annotated[int, typer.Option(help="Independent samples of a single prompt.")] = 1,
    fan_out: Annotated[str | None, typer.Option(help="SSD fan-out per accepted length after a hit, e.g. 3,3,2,2,1, or auto.")] = None,
    fan_out_miss: Annotated[str | None, typer.Option(help="SSD fan-out after a miss, or auto.")] = None,
    saguaro_c: Annotated[float, typer.Option(help="Saguaro sampling constant C in (0, 1].")] = 1.0,
    backup: Annotated[str, typer.Option(help="SSD backup on a miss: auto | jit | ngram | none")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming.")] = False,
) -> None:
    """Generate text, streaming tokens as they are accepted."""
    from .config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
    from .errors import UsageError

    try:
        mode_enum = Mode(mode)
    except ValueError:
        raise UsageError(f"unknown mode {mode!r}", "choose one of: ar, sd, ssd") from None
    if num_samples < 1:
        raise UsageError(f"num-samples must be >= 1, got {num_samples}", "use --num-samples 1")
    if num_samples > 1 and len(prompts) != 1:
        raise UsageError("--num-samples needs exactly one prompt", "pass a single prompt")
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt", "pass some text to generate from")
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=tuple(stop or ()),
    )
    if target is not None and mode_enum is not Mode.AR and draft is None:
        raise UsageError(f"--mode {mode} needs --draft", "pass --draft PATH or --draft ngram, or use --mode ar")
    spec_options = {
        "mode": mode_enum, "k": k, "fan_out": parse_fan_out(fan_out), "fan_out_miss": parse_fan_out(fan_out_miss),
        "saguaro_c": saguaro_c, "backup": backup,
    }
    tp_devices: tuple[str, ...] = ()
    auto_place = target_devices is not None and target_devices.strip() == "auto"
    if target_devices is not None and not auto_place:
        from .parallel.devarg import parse_devices

        tp_devices = parse_devices(target_devices)
        target_device = tp_devices[0]
    # validate every option before the default pair is fetched (which can take minutes)
    SpecConfig(**spec_options, draft=(draft or "default") if mode_enum is not Mode.AR else None)
    ModelSpec(target or "default", target_device, dtype, target_backend)
    ModelSpec(draft or "default", draft_device, dtype, draft_backend)
    if pair is not None and target is None:
        from .pairs import resolve_pair_paths

        target, pair_draft = resolve_pair_paths(pair, dtype=dtype)
        draft = draft or pair_draft
    if target is None:
        target, default_draft = _default_pair(dtype, (target_backend, draft_backend))
        draft = draft or default_draft
    if auto_place:
        from .parallel.auto import auto_devices

        tp_devices, draft_device = auto_devices(target, draft if mode_enum is not Mode.AR else None, dtype)
        target_device = tp_devices[0]
    spec = SpecConfig(**spec_options, draft=draft if mode_enum is not Mode.AR else None)
    config = EngineConfig(
        target=ModelSpec(target, target_device, dtype, target_backend),
        spec=spec,
        draft_model=ModelSpec(draft, draft_device, dtype, draft_backend) if spec.draft and not spec.draft_is_ngram else None,
        target_devices=tp_devices if len(tp_devices) > 1 else (),
    )
    from .clirender import run_generate

    run_generate(config, list(prompts) * num_samples, params, chat=chat, as_json=as_json)


def _default_pair(dtype: str, backends: tuple[str, str] = ("torch", "torch")) -> tuple[str, str]:
    from .assets import ensure_default_pair
    from .clirender import progress_callback

    with progress_callback() as progress:
        if backends == ("torch", "torch"):
            target, draft = ensure_default_pair(progress=progress, dtype=dtype)
            return str(target), str(draft)
        from .assets import DEFAULT_DRAFT, DEFAULT_TARGET, fetch_gguf

        paths = []  # llama.cpp reads the GGUF itself; torch gets it converted
        for name, backend in zip((DEFAULT_TARGET, DEFAULT_DRAFT), backends):
            path = fetch_gguf(name, progress=progress)
            if backend == "torch":
                from .backends.torch_backend.gguf_convert import ensure_converted

                path = ensure_converted(path, progress=progress, dtype=dtype)
            paths.append(str(path))
    return paths[0], paths[1]


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
        if type(exc).__name__ == "NoArgsIsHelpError":  # Typer already printed the help
            raise SystemExit(exc.exit_code) from None
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "ssdlocal"
        _fail(exc.format_message(), f"run `{where} --help` for usage", exc.exit_code)
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        _log_traceback()
        _fail(
            f"out of memory: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            "use fewer prompts, a smaller --max-new-tokens, --dtype bfloat16, or another device",
            1,
        )
    if _STATE["verbose"]:
        raise exc
    _fail(
        f"unexpected {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "),
        "this is a bug; rerun with --verbose for the traceback and report it",
        1,
    )


from .cli_bench import bench as _bench  # noqa: E402
app.command("bench")(_bench)


from . import cli_tui as _tui  # noqa: E402
app.command("chat")(_tui.chat)
app.command("race")(_tui.race)

from . import cli_models as _models  # noqa: E402
app.command("pairs")(_models.pairs)
app.command("pull")(_models.pull)
app.command("devices")(_models.devices)
app.command("check")(_models.check)
