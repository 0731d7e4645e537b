"""One entry point per job for every backend: load a model, make its runner, read its
tokenizer, check a path cheaply before anything heavy happens, build what a backend will
read ahead of the load (`prepare_weights`), size its quantized weights, and report a
runner's captured graphs.

Callers (engine, SSD worker, compatibility checks) never branch on the backend name
themselves. Backends are imported lazily: llama_cpp only when a GGUF runs through it.
"""

from __future__ import annotations

from pathlib import Path

from ssdlocal.core.config import ModelSpec


def load(spec: ModelSpec, *, threads: int | None = None):
    """Load `spec`'s model on its backend: torch (HF dir or converted .gguf) or llama.cpp.

    `threads` is llama.cpp's CPU thread count (None: torch's count at each decode);
    the torch backend uses torch's own thread setting.
    """
    if spec.backend == "llamacpp":
        from ssdlocal.backends.llamacpp import load_gguf

        return load_gguf(spec.path, spec.device, threads)
    from ssdlocal.backends.torch.loader import load_model

    return load_model(spec.path, spec.device, spec.dtype, spec.quantization)


def claim_device(device: str) -> None:
    """Make `device` the current CUDA device of this process (a process that owns a model
    on a GPU other than cuda:0 must, or work lands on the wrong GPU); no-op otherwise."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def make_runner(loaded, *, tree: bool = False, graphs: str = "auto"):
    """The Runner for a loaded model. `tree`: it will decode SSD fan-out trees (llama.cpp
    sizes its context for many sequences). `graphs`: captured forwards for the torch
    runner ("auto" = CUDA graphs on CUDA, "off", "trace"); llama.cpp has its own."""
    from ssdlocal.backends.llamacpp import LlamaCppRunner, LoadedGGUF

    if isinstance(loaded, LoadedGGUF):
        return LlamaCppRunner(loaded, tree=tree)
    from ssdlocal.backends.torch.runner import TorchRunner

    return TorchRunner(loaded, graphs=graphs)


def load_tokenizer(path: str, backend: str = "torch"):
    """The model's tokenizer (transformers), reading no weights."""
    if backend == "llamacpp":
        from ssdlocal.backends.llamacpp import gguf_tokenizer

        return gguf_tokenizer(path)
    from ssdlocal.weights.formats.checkpoint import (
        load_tokenizer as checkpoint_tokenizer,
    )

    return checkpoint_tokenizer(path)


def preflight(path: str, backend: str = "torch") -> None:
    """Cheap checks of a checkpoint (files, config, architecture) without reading weights."""
    if backend == "llamacpp":
        from ssdlocal.backends.llamacpp import preflight as gguf_preflight

        gguf_preflight(path)
        return
    from ssdlocal.backends.torch.model import ModelArgs
    from ssdlocal.weights.formats.checkpoint import (
        config_dir,
        load_hf_config,
        weight_files,
    )

    ckpt = config_dir(path)  # a .gguf: its metadata only; weights are converted when loaded
    ModelArgs.from_hf_config(load_hf_config(ckpt))
    if ckpt.resolve() == Path(path).expanduser().resolve():
        weight_files(ckpt)


def prepare_weights(path: str | Path, backend: str = "torch", quantization: str = "none",
                    dtype: str = "bfloat16", progress=None, *, floats: bool = True) -> Path:  # fmt: skip
    """What `backend` will read for `path`, built now if it is not cached (with progress):
    for torch, a .gguf file's quantized cache (int8/int4 as `quantization` resolves for the
    file) or else its float conversion (`floats=False`: the file itself, nothing converted),
    and a checkpoint directory itself; llama.cpp reads the path as it is."""
    if backend == "llamacpp":
        return Path(path).expanduser()
    from ssdlocal.backends.torch.loader import prepare_weights as torch_prepare

    return torch_prepare(path, quantization, dtype, progress, floats=floats)


def attention_heads(path: str | Path) -> tuple[int, int]:
    """(attention heads, key/value heads) of the torch model of `path`, from its config
    (a .gguf file's metadata directory): what tensor parallelism divides."""
    from ssdlocal.backends.torch.model import ModelArgs
    from ssdlocal.weights.formats.checkpoint import config_dir, load_hf_config

    args = ModelArgs.from_hf_config(load_hf_config(config_dir(path)))
    return (args.num_heads, args.num_kv_heads)


def quantized_bytes(path: str | Path, quantization: str, dtype: str, device_type: str = "cpu") -> int | None:
    """Bytes the torch backend's weights of `path` take once loaded with `quantization`
    (int8 | int4 | auto) in `dtype` on a `device_type` device, from file headers only;
    None when the weights resolve to floats (no quantization to size)."""
    from ssdlocal.weights.formats.quantized import resolve_scheme

    scheme = resolve_scheme(path, quantization)
    if scheme == "none":
        return None
    from ssdlocal.backends.torch.quant_load import weight_bytes

    return weight_bytes(path, scheme, dtype, device_type)


def graph_report(runner, since: dict | None = None) -> dict:
    """A runner's captured-graph counts as plain data ({"mode", "captured", "replays",
    "eager", "refused", "dropped"}, + "notes"), minus `since` (an earlier report of the
    same runner); mode "off" for a runner without graphs (llama.cpp's)."""
    from ssdlocal.backends.torch.graphs import graph_report as torch_report

    return torch_report(runner, since)


def gguf_source(path: str | None) -> str | None:
    """The GGUF file a model path came from, when known: the path itself (.gguf), or the
    source of a cached conversion (float or quantized) whose file is still on disk."""
    if not path:
        return None
    found = Path(path).expanduser()
    if found.is_file() and found.suffix.lower() == ".gguf":
        return str(found)
    import json

    from ssdlocal.core.paths import cache_dir

    for marker in ("quantization.json", "ssdlocal-convert.json"):
        try:
            info = json.loads((found / marker).read_text())
        except (OSError, ValueError):
            continue
        for candidate in (info.get("path"), cache_dir() / "gguf" / str(info.get("source", ""))):
            if candidate and Path(candidate).is_file() and str(candidate).endswith(".gguf"):
                return str(candidate)
    return None
