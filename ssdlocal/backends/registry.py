"""The backends, one `backends.base.Backend` each, in one table: `backend_for(name)` is the
lookup, and the module functions here (load, make_runner, load_tokenizer, preflight,
prepare_weights, context_length) go through it.

A backend is named by core.models.BackendName (parsed once from the user's text at the
CLI / config edge); its facts are the name's, what it does its package's Backend
(backends/torch/backend.py, backends/llamacpp/backend.py). Callers (engine, SSD worker,
compatibility checks, placement, weights) never branch on the name themselves. A backend's
package is imported when the backend is first asked for, and its heavy libraries inside
its methods: llama_cpp only when a GGUF runs through it. A new backend is a BackendName
member (core/models.py), its package here with its Backend, and its row in FACTORIES.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ssdlocal.backends.base import Backend, HeadInputs, Runner
from ssdlocal.core.config import GraphMode
from ssdlocal.core.models import BackendName, ModelSpec
from ssdlocal.core.quantization import DEFAULT_DTYPE, DType, Quantization


def _torch() -> Backend:
    from ssdlocal.backends.torch.backend import TorchBackend

    return TorchBackend()


def _llamacpp() -> Backend:
    from ssdlocal.backends.llamacpp.backend import LlamaCppBackend

    return LlamaCppBackend()


FACTORIES: dict[BackendName, Callable[[], Backend]] = {
    BackendName.TORCH: _torch,
    BackendName.LLAMACPP: _llamacpp,
}


@cache
def _made(name: BackendName) -> Backend:
    return FACTORIES[name]()


def backend_for(name: BackendName | str) -> Backend:
    """The Backend named `name` (a member, or text: UsageError with the choices when unknown)."""
    return _made(BackendName.parse(name, "backend"))


def load(spec: ModelSpec, *, threads: int | None = None) -> Any:
    """Load `spec`'s model on its backend: torch (HF dir or converted .gguf) or llama.cpp.

    `threads` is llama.cpp's CPU thread count (None: torch's count at each decode);
    the torch backend uses torch's own thread setting.
    """
    return backend_for(spec.backend).load(spec, threads)


def claim_device(device: str) -> None:
    """Make `device` the current CUDA device of this process (a process that owns a model
    on a GPU other than cuda:0 must, or work lands on the wrong GPU); no-op otherwise."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def make_runner(loaded: Any, *, tree: bool = False, graphs: GraphMode = GraphMode.AUTO) -> Runner:
    """The Runner for a loaded model, by the backend that loaded it (`loaded.backend`).
    `tree`: it will decode SSD fan-out trees (llama.cpp sizes its context for many
    sequences). `graphs`: captured forwards for the torch runner (AUTO = CUDA graphs on
    CUDA)."""
    return backend_for(loaded.backend).make_runner(loaded, tree, graphs)


def context_length(path: str, name: BackendName) -> int | None:
    """A model's context (positions) read without loading it, where its backend takes it
    as stored (Backend.context_length); None where it cannot say."""
    return backend_for(name).context_length(path)


def load_head(kind: str, path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
    """The runner of a draft head (Backend.load_head): heads are our own torch modules, run
    beside a target that shares its embeddings (only a torch target can: Runner.head_inputs)."""
    return backend_for(BackendName.TORCH).load_head(kind, path, shared, target_vocab, device)


def load_tokenizer(path: str, name: BackendName = BackendName.TORCH) -> Any:
    """The model's tokenizer (transformers), reading no weights."""
    return backend_for(name).load_tokenizer(path)


def preflight(path: str, name: BackendName = BackendName.TORCH) -> None:
    """Cheap checks of a checkpoint (files, config, architecture) without reading weights."""
    backend_for(name).preflight(path)


def prepare_weights(
    path: str | Path,
    name: BackendName = BackendName.TORCH,
    quantization: Quantization = Quantization.NONE,
    dtype: DType = DEFAULT_DTYPE,
    progress=None,
    *,
    floats: bool = True,
) -> Path:
    """What backend `name` will read for `path`, built now if it is not cached (with
    progress): for torch, a .gguf file's quantized cache (int8/int4 as `quantization`
    resolves for the file) or else its float conversion (`floats=False`: the file itself,
    nothing converted), and a checkpoint directory itself; llama.cpp reads the path as it is."""
    return backend_for(name).prepare(path, quantization, dtype, progress, floats)
