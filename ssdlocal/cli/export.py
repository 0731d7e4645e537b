"""`ssdlocal export --to vllm|sglang|llama-server`: the command that serves the same pair
with the same speculation settings on another engine.

Wiring and printing only: the settings are ssdlocal.bench.export, each engine's command
line and config file ssdlocal.bench.export_engines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


def export(
    to: Annotated[str, typer.Option("--to", metavar="ENGINE", help="vllm | sglang | llama-server")],
    pair: Annotated[
        str | None, typer.Option(metavar="PAIR", help="Pair name or .toml file. Default: the built-in offline pair.")
    ] = None,
    k: Annotated[int | None, typer.Option("--k", metavar="K", help="Speculative tokens per round.")] = None,
    from_bench: Annotated[
        Path | None,
        typer.Option(
            metavar="RESULTS",
            help="A `bench` results.json: K as measured there. Default K: the pair's suggested one.",
        ),
    ] = None,
    context: Annotated[
        int | None, typer.Option(metavar="N", help="Context in tokens. Default: both models' own.")
    ] = None,
    tensor_parallel: Annotated[
        int | None, typer.Option(metavar="N", help="Tensor-parallel size. Default: the placement plan's.")
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(metavar="N", help="Plan for a machine with N GPUs (with --gpu-memory).")
    ] = None,
    gpu_memory: Annotated[float | None, typer.Option(metavar="GB", help="Memory of each of those GPUs.")] = None,
    served_model_name: Annotated[
        str | None, typer.Option(metavar="NAME", help="The model id clients send. Default: the pair's name.")
    ] = None,
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address the engine listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", help="Port the engine listens on.")] = 8000,
    write_config: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Write the engine's config file there (vllm, sglang) and print its command."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the command (and config file) that serves the pair on vLLM, SGLang or llama-server."""
    from ssdlocal.bench.export import (
        Engine,
        ExportRequest,
        Sourced,
        destination,
        export_settings,
        measured_k,
        read_bench,
    )
    from ssdlocal.bench.export_engines import export as build
    from ssdlocal.core.errors import UsageError
    from ssdlocal.placement.inventory import detect
    from ssdlocal.weights.hub import OFFLINE_PAIR
    from ssdlocal.weights.pairs import get_pair

    engine = Engine.parse(to, "--to")
    found = get_pair(pair or OFFLINE_PAIR)
    if k is not None and from_bench is not None:
        raise UsageError("--k and --from-bench both set K", "give one of them")
    if k is not None:
        chosen = Sourced(k, "given")
    elif from_bench is not None:
        chosen = measured_k(read_bench(from_bench), str(from_bench))
    else:
        chosen = Sourced(found.suggested_k, f"the pair's suggested K ({found.file.name if found.file else found.name})")
    gguf = _gguf_files(found)
    asked = ExportRequest(chosen, context, tensor_parallel, served_model_name, host, port)
    settings = export_settings(engine, found, destination(gpus, gpu_memory, detect()), asked, gguf, _contexts(gguf))
    result = build(settings)
    if write_config is not None:
        if result.config_name is None:
            raise UsageError(f"{engine} takes no config file", "drop --write-config: the command line is complete")
        write_config.write_text(result.config_text() or "")
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return
    _print(result, write_config)


def _gguf_files(pair) -> tuple[str, str] | None:
    """The pair's GGUF files on this machine (trusted ones), or None."""
    from ssdlocal.core.errors import SSDLocalError
    from ssdlocal.core.models import BackendName
    from ssdlocal.weights.hub import local_paths

    if BackendName.LLAMACPP not in pair.backends:
        return None
    try:
        return local_paths(pair, BackendName.LLAMACPP, trust_new=False)
    except SSDLocalError:
        return None


def _contexts(gguf: tuple[str, str] | None) -> tuple[int | None, int | None]:
    from ssdlocal.backends.registry import context_length
    from ssdlocal.core.models import BackendName

    if gguf is None:
        return None, None
    return context_length(gguf[0], BackendName.LLAMACPP), context_length(gguf[1], BackendName.LLAMACPP)


def _print(result, written: Path | None) -> None:
    s = result.settings
    out = sys.stdout.write
    out(f"# {s.engine}: {s.pair}, target {s.target}, draft {s.draft}\n")
    out(f"# K = {s.k.value}: {s.k.source}\n")
    out(f"# tensor parallel = {s.tensor_parallel.value}: {s.tensor_parallel.source}\n")
    if s.context.value is not None:
        out(f"# context = {s.context.value}: {s.context.source}\n")
    if written is not None:
        out(f"# config written to {written}\n{result.config_command(str(written))}\n")
    else:
        out(result.command() + "\n")
        if result.config_name is not None:
            out(f"# or with a config file: put this in {result.config_name}, then run `{result.config_command()}`\n")
            out("".join(f"#   {line}\n" for line in (result.config_text() or "").splitlines()))
    if result.legacy:
        out(f"# {result.legacy}\n")
    out("# what is lost on the way:\n")
    out("".join(f"#   - {note}\n" for note in result.notes))
