"""The llama.cpp backend as the registry sees it (backends.base.Backend): a .gguf file run as it
is by llama-cpp-python, in the file's own quantization. llama_cpp is imported inside the
methods only, after probe.py has seen it run on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ssdlocal.core.config import GraphMode
from ssdlocal.core.models import BackendName, ModelSpec
from ssdlocal.core.quantization import DType, Quantization


class LlamaCppBackend:
    """backends.base.Backend for GGUF files through llama.cpp."""

    name = BackendName.LLAMACPP

    def load(self, spec: ModelSpec, threads: int | None) -> Any:
        from ssdlocal.backends.llamacpp.loader import load_gguf

        return load_gguf(spec.path, spec.device, threads, batch_invariant=spec.batch_invariant)

    def make_runner(self, loaded: Any, tree: bool, graphs: GraphMode) -> Any:
        from ssdlocal.backends.llamacpp.runner import LlamaCppRunner

        return LlamaCppRunner(loaded, tree=tree)  # llama.cpp has its own graphs

    def load_tokenizer(self, path: str) -> Any:
        from ssdlocal.backends.llamacpp.loader import gguf_tokenizer

        return gguf_tokenizer(path)

    def preflight(self, path: str) -> None:
        from ssdlocal.backends.llamacpp import preflight

        preflight(path)

    def prepare(self, path: str | Path, quantization: Quantization, dtype: DType, progress: Any, floats: bool) -> Path:
        return Path(path).expanduser()  # llama.cpp reads the file as it is

    def build(self) -> Any:
        from ssdlocal.backends.llamacpp.probe import library_identity

        return library_identity()  # version and native files: a rebuild with other flags is another library

    def load_head(self, kind: str, path: str, shared: Any, target_vocab: int, device: Any) -> Any:
        from ssdlocal.core.errors import UsageError

        raise UsageError(
            f"llama.cpp does not run draft heads ({kind} head {path})",
            "run the target on the torch backend (--target-backend torch), or use a draft model",
        )

    def context_length(self, path: str) -> int | None:
        """The GGUF header's context length (llama.cpp's n_ctx_train); None for a header
        without one or a file that is no readable GGUF (its load says why)."""
        from ssdlocal.core.errors import ModelLoadError
        from ssdlocal.weights.formats.convert import gguf_metadata

        try:
            found = gguf_metadata(Path(path)).get("context_length")
        except ModelLoadError:
            return None
        return found if isinstance(found, int) else None
