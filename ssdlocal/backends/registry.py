"""One entry point per job for every backend: load a model, make its runner, read its
tokenizer, and check a path cheaply before anything heavy happens.

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
    from ssdlocal.backends.torch.loader import load_tokenizer as torch_tokenizer

    return torch_tokenizer(path)


def preflight(path: str, backend: str = "torch") -> None:
    """Cheap checks of a checkpoint (files, config, architecture) without reading weights."""
    if backend == "llamacpp":
        from ssdlocal.backends.llamacpp import preflight as gguf_preflight

        gguf_preflight(path)
        return
    from ssdlocal.backends.torch.loader import config_dir, load_hf_config, weight_files
    from ssdlocal.backends.torch.model import ModelArgs

    ckpt = config_dir(path)  # a .gguf: its metadata only; weights are converted when loaded
    ModelArgs.from_hf_config(load_hf_config(ckpt))
    if ckpt.resolve() == Path(path).expanduser().resolve():
        weight_files(ckpt)


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
