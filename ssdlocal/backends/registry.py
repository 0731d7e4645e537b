"""The backends, one `Backend` object each, in one table (`BACKENDS`): load a model, make
its runner, read its tokenizer, check a path cheaply before anything heavy happens, build
what a backend will read ahead of the load (`prepare_weights`), make a device this
process's own; and what only the torch backend knows about weights (`quantized_bytes`,
`attention_heads`).

A backend is named by core.models.BackendName (parsed once from the user's text at the
CLI / config edge); `backend_for(name)` is the lookup. Callers (engine, SSD worker,
compatibility checks, placement, weights) never branch on the name themselves. The
backends' code is imported lazily: llama_cpp only when a GGUF runs through it. A new
backend is a BackendName member (core/models.py), its package here, and its row in
BACKENDS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssdlocal.core.models import BackendName, ModelSpec


@dataclass(frozen=True)
class Backend:
    """What one backend does. `load(spec, threads)` -> its loaded model (`threads`: CPU
    threads where the backend takes them, None: its default); `make_runner(loaded, tree,
    graphs)` -> a backends.base.Runner; `load_tokenizer(path)` -> a transformers tokenizer,
    reading no weights; `preflight(path)`: cheap checks of the files (raises
    ModelLoadError/UsageError with a hint); `prepare(path, quantization, dtype, progress,
    floats)` -> the path `load` will read, built now if not cached; `owns(loaded)`: whether
    `loaded` came from this backend's `load`; `build()` -> what identifies the library the
    kernels come from beyond the machine's own key (core/measured.machine has torch's
    version), so timings kept for one build are not trusted for another. Facts about the
    backend are its `name`'s (BackendName)."""

    name: BackendName
    load: Callable[[ModelSpec, int | None], Any]
    make_runner: Callable[[Any, bool, str], Any]
    load_tokenizer: Callable[[str], Any]
    preflight: Callable[[str], None]
    prepare: Callable[[str | Path, str, str, Any, bool], Path]
    owns: Callable[[Any], bool]
    build: Callable[[], Any]


# ------------------------------------------------------------------ torch
def _torch_load(spec: ModelSpec, threads: int | None):
    from ssdlocal.backends.torch.loader import load_model

    return load_model(spec.path, spec.device, spec.dtype, spec.quantization)  # torch's own thread setting


def _torch_runner(loaded, tree: bool, graphs: str):
    from ssdlocal.backends.torch.runner import TorchRunner

    return TorchRunner(loaded, graphs=graphs)  # static slots: a tree needs no other sizing


def _torch_tokenizer(path: str):
    from ssdlocal.weights.formats.checkpoint import load_tokenizer

    return load_tokenizer(path)


def _torch_preflight(path: str) -> None:
    from ssdlocal.backends.torch.model import ModelArgs
    from ssdlocal.weights.formats.checkpoint import config_dir, load_hf_config, weight_files

    ckpt = config_dir(path)  # a .gguf: its metadata only; weights are converted when loaded
    ModelArgs.from_hf_config(load_hf_config(ckpt))
    if ckpt.resolve() == Path(path).expanduser().resolve():
        weight_files(ckpt)


def _torch_prepare(path: str | Path, quantization: str, dtype: str, progress, floats: bool) -> Path:
    from ssdlocal.backends.torch.loader import prepare_weights

    return prepare_weights(path, quantization, dtype, progress, floats=floats)


# ------------------------------------------------------------------ llama.cpp
def _llamacpp_load(spec: ModelSpec, threads: int | None):
    from ssdlocal.backends.llamacpp import load_gguf

    return load_gguf(spec.path, spec.device, threads, batch_invariant=spec.batch_invariant)


def _llamacpp_runner(loaded, tree: bool, graphs: str):
    from ssdlocal.backends.llamacpp import LlamaCppRunner

    return LlamaCppRunner(loaded, tree=tree)  # llama.cpp has its own graphs


def _llamacpp_tokenizer(path: str):
    from ssdlocal.backends.llamacpp import gguf_tokenizer

    return gguf_tokenizer(path)


def _llamacpp_preflight(path: str) -> None:
    from ssdlocal.backends.llamacpp import preflight

    preflight(path)


def _llamacpp_prepare(path: str | Path, quantization: str, dtype: str, progress, floats: bool) -> Path:
    return Path(path).expanduser()  # llama.cpp reads the file as it is


def _llamacpp_owns(loaded) -> bool:
    from ssdlocal.backends.llamacpp.loader import LoadedGGUF

    return isinstance(loaded, LoadedGGUF)


def _llamacpp_build() -> Any:
    from ssdlocal.backends.llamacpp.probe import library_identity

    return library_identity()  # version and native files: a rebuild with other flags is another library


BACKENDS: dict[BackendName, Backend] = {
    BackendName.LLAMACPP: Backend(
        BackendName.LLAMACPP,
        _llamacpp_load,
        _llamacpp_runner,
        _llamacpp_tokenizer,
        _llamacpp_preflight,
        _llamacpp_prepare,
        _llamacpp_owns,
        _llamacpp_build,
    ),
    # last: what no other backend owns is a torch model (a tensor-parallel group included)
    BackendName.TORCH: Backend(
        BackendName.TORCH,
        _torch_load,
        _torch_runner,
        _torch_tokenizer,
        _torch_preflight,
        _torch_prepare,
        lambda loaded: True,
        lambda: None,
    ),
}


def backend_for(name: BackendName | str) -> Backend:
    """The Backend named `name` (a member, or text: UsageError with the choices when unknown)."""
    return BACKENDS[BackendName.parse(name, "backend")]


def load(spec: ModelSpec, *, threads: int | None = None):
    """Load `spec`'s model on its backend: torch (HF dir or converted .gguf) or llama.cpp.

    `threads` is llama.cpp's CPU thread count (None: torch's count at each decode);
    the torch backend uses torch's own thread setting.
    """
    return BACKENDS[spec.backend].load(spec, threads)


def claim_device(device: str) -> None:
    """Make `device` the current CUDA device of this process (a process that owns a model
    on a GPU other than cuda:0 must, or work lands on the wrong GPU); no-op otherwise."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def make_runner(loaded, *, tree: bool = False, graphs: str = "auto"):
    """The Runner for a loaded model, by the backend that loaded it. `tree`: it will decode
    SSD fan-out trees (llama.cpp sizes its context for many sequences). `graphs`: captured
    forwards for the torch runner ("auto" = CUDA graphs on CUDA, "off", "trace")."""
    owner = next(b for b in BACKENDS.values() if b.owns(loaded))
    return owner.make_runner(loaded, tree, graphs)


def context_length(path: str, name: BackendName) -> int | None:
    """A model's context (positions) read without loading it, where its backend takes it
    as stored: a GGUF header's context length for llama.cpp (its n_ctx_train). None for
    other backends (torch may extend it by rope scaling), a header without one, or a file
    that is no readable GGUF (its load says why)."""
    if BackendName(name) is not BackendName.LLAMACPP:
        return None
    from ssdlocal.core.errors import ModelLoadError
    from ssdlocal.weights.formats.convert import gguf_metadata

    try:
        found = gguf_metadata(Path(path)).get("context_length")
    except ModelLoadError:
        return None
    return found if isinstance(found, int) else None


def load_tokenizer(path: str, name: BackendName = BackendName.TORCH):
    """The model's tokenizer (transformers), reading no weights."""
    return BACKENDS[name].load_tokenizer(path)


def preflight(path: str, name: BackendName = BackendName.TORCH) -> None:
    """Cheap checks of a checkpoint (files, config, architecture) without reading weights."""
    BACKENDS[name].preflight(path)


def prepare_weights(
    path: str | Path,
    name: BackendName = BackendName.TORCH,
    quantization: str = "none",
    dtype: str = "bfloat16",
    progress=None,
    *,
    floats: bool = True,
) -> Path:
    """What backend `name` will read for `path`, built now if it is not cached (with
    progress): for torch, a .gguf file's quantized cache (int8/int4 as `quantization`
    resolves for the file) or else its float conversion (`floats=False`: the file itself,
    nothing converted), and a checkpoint directory itself; llama.cpp reads the path as it is."""
    return BACKENDS[BackendName.parse(name, "backend")].prepare(path, quantization, dtype, progress, floats)


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
