"""The torch backend as the registry sees it (backends.base.Backend): our native models from
checkpoint directories or converted GGUF files, quantized by `--quantization`, tensor
parallel over several devices. Heavy imports happen inside the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ssdlocal.core.config import GraphMode
from ssdlocal.core.models import BackendName, ModelSpec
from ssdlocal.core.quantization import DType, Quantization


class TorchBackend:
    """backends.base.Backend for our own torch models."""

    name = BackendName.TORCH

    def load(self, spec: ModelSpec, threads: int | None) -> Any:
        from ssdlocal.backends.torch.loader import load_model

        return load_model(spec.path, spec.device, spec.dtype, spec.quantization)  # torch's own thread setting

    def make_runner(self, loaded: Any, tree: bool, graphs: GraphMode) -> Any:
        from ssdlocal.backends.torch.models.hybrid import HybridLM
        from ssdlocal.backends.torch.runner import TorchRunner

        model = getattr(loaded.model, "shard", loaded.model)  # rank 0's shard of a tensor-parallel one
        if isinstance(model, HybridLM):  # linear-attention states beside the KV cache
            from ssdlocal.backends.torch.hybrid_runner import HybridRunner

            return HybridRunner(loaded, graphs=graphs)
        return TorchRunner(loaded, graphs=graphs)  # static slots: a tree needs no other sizing

    def load_tokenizer(self, path: str) -> Any:
        from ssdlocal.weights.formats.checkpoint import load_tokenizer

        return load_tokenizer(path)

    def preflight(self, path: str) -> None:
        """The config names an architecture we implement, with fields we implement; a
        checkpoint directory has its weight files (a .gguf: its metadata only)."""
        from ssdlocal.backends.torch.models import args_from_config
        from ssdlocal.weights.formats.checkpoint import config_dir, load_hf_config, weight_files

        ckpt = config_dir(path)
        args_from_config(load_hf_config(ckpt))
        if ckpt.resolve() == Path(path).expanduser().resolve():
            weight_files(ckpt)

    def prepare(self, path: str | Path, quantization: Quantization, dtype: DType, progress: Any, floats: bool) -> Path:
        from ssdlocal.backends.torch.loader import prepare_weights

        return prepare_weights(path, quantization, dtype, progress, floats=floats)

    def build(self) -> Any:
        return None  # torch's version is part of the machine's key already

    def load_head(self, kind: str, path: str, shared: Any, target_vocab: int, device: Any) -> Any:
        from ssdlocal.backends.torch.heads import load_head

        return load_head(kind, path, shared, target_vocab, device)

    def context_length(self, path: str) -> int | None:
        return None  # rope scaling may extend what a file states: known once loaded
