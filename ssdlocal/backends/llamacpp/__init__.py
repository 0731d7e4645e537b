"""llama.cpp backend (llama-cpp-python, GGUF files): loader, runner, thin C-API adapter.

Nothing here imports llama_cpp at import time; `load_gguf` does, with an install hint,
after probe.py has seen llama.cpp run on this machine in a child process.
"""

from ssdlocal.backends.llamacpp.loader import (
    GGUFArgs,
    LoadedGGUF,
    check_gguf_file,
    gguf_tokenizer,
    load_gguf,
)
from ssdlocal.backends.llamacpp.runner import LlamaCppRunner

__all__ = [
    "GGUFArgs",
    "LlamaCppRunner",
    "LoadedGGUF",
    "check_gguf_file",
    "gguf_tokenizer",
    "load_gguf",
    "preflight",
]


def preflight(path: str) -> None:
    """Cheap checks before a worker loads a GGUF: the file, that llama_cpp imports, and
    that llama.cpp passed its probe on this machine (cached after the first time)."""
    from ssdlocal.backends.llamacpp.lib import import_llama_cpp
    from ssdlocal.backends.llamacpp.probe import require_llamacpp

    check_gguf_file(path)
    import_llama_cpp()
    require_llamacpp()
