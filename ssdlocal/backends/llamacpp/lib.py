"""The only module that touches llama-cpp-python: a thin adapter over its low-level C API.

LlamaLib exposes what LlamaCppRunner needs (load a GGUF, make a context with a unified
multi-sequence KV cache, decode one llama_batch with per-token logits flags, remove /
copy sequence ranges). Tests swap in a fake with the same methods, so the runner's
bookkeeping is tested without the compiled library. Imported lazily, never at import
time of ssdlocal. Before it loads a model it asks probe.py whether llama.cpp ran on this
machine (a crash there becomes an error with a hint, and CPU weight repacking is turned
off where only that crashed).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence

import numpy as np

from ssdlocal.backends.llamacpp.probe import INSTALL_HINT, require_llamacpp
from ssdlocal.core.errors import ModelLoadError, OutOfMemoryError

log = logging.getLogger(__name__)
_BACKEND_READY = False
_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a hybrid model's recurrent state alone


def import_llama_cpp():
    """The `llama_cpp` module, or ModelLoadError with the install hint."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(
            "the llama.cpp backend needs llama-cpp-python, which is not installed", INSTALL_HINT
        ) from exc
    except OSError as exc:  # the shared library failed to load
        raise ModelLoadError(
            f"llama-cpp-python is installed but its library failed to load: {exc}",
            "reinstall it: pip install --force-reinstall --no-cache-dir llama-cpp-python",
        ) from exc
    return llama_cpp


def can_disable_extra_bufts(ll) -> bool:
    """Whether this llama-cpp-python exposes `use_extra_bufts` in llama_model_params."""
    return hasattr(ll.llama_model_params, "use_extra_bufts")


def high_level_llama(**kwargs):
    """llama-cpp-python's own `Llama(**kwargs)` (the benchmark's peers) under the probe's
    verdict: ModelLoadError where llama.cpp crashed here, repacking off where only that did.
    `Llama` takes no such option, so its default model params are wrapped while it loads."""
    try:
        return _llama(import_llama_cpp(), kwargs)
    finally:  # Llama(verbose=False) lets error-level notices through: ours see none of them
        quiet_logs(bool(kwargs.get("verbose", True)))


def _llama(ll, kwargs: dict):
    if require_llamacpp().extra_bufts:
        return ll.Llama(**kwargs)
    module = ll.llama_cpp  # where Llama reads llama_model_default_params from
    defaults = module.llama_model_default_params

    def without_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = without_repacking
    try:
        return ll.Llama(**kwargs)
    finally:
        module.llama_model_default_params = defaults


def quiet_logs(verbose: bool) -> None:
    """llama.cpp's log lines (through llama-cpp-python's logger): every one when `verbose`,
    none otherwise. `Llama(verbose=False)` sets the level to ERROR, which still prints the
    error-level notices llama.cpp gives for later contexts (e.g. "n_ctx_seq > n_ctx_train"
    under a benchmark's table), and some come at level NONE, mapped to CRITICAL: quiet is
    above both."""
    try:
        from llama_cpp._logger import set_verbose

        set_verbose(verbose)
    except ImportError:  # pragma: no cover - older layouts
        pass
    if not verbose:
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL + 10)


class LlamaLib:
    """llama.cpp calls used by the runner; every pointer stays inside this class.

    `extra_bufts`: whether llama.cpp may use its extra buffer types (CPU weight
    repacking); None asks the probe (probe.require_llamacpp), which raises
    ModelLoadError when llama.cpp crashed on this machine.
    """

    def __init__(self, verbose: bool = False, extra_bufts: bool | None = None) -> None:
        global _BACKEND_READY
        self.ll = import_llama_cpp()
        if extra_bufts is None:
            extra_bufts = require_llamacpp().extra_bufts
        self.extra_bufts = extra_bufts
        quiet_logs(verbose)  # llama.cpp's stderr chatter goes through its Python logger
        if not _BACKEND_READY:
            self.ll.llama_backend_init()
            _BACKEND_READY = True
        self._batches: dict[int, tuple[object, int]] = {}  # id(ctx) -> (llama_batch, capacity)

    # ------------------------------------------------------------------ models
    def supports_gpu(self) -> bool:
        return bool(self.ll.llama_supports_gpu_offload())

    def max_sequences(self) -> int:
        return int(self.ll.llama_max_parallel_sequences())

    def load_model(self, path: str, n_gpu_layers: int, main_gpu: int):
        params = self.ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.main_gpu = main_gpu
        if n_gpu_layers and hasattr(self.ll, "LLAMA_SPLIT_MODE_NONE"):
            params.split_mode = self.ll.LLAMA_SPLIT_MODE_NONE  # one GPU: main_gpu
        if not self.extra_bufts:
            params.use_extra_bufts = False  # no CPU weight repacking (it crashed in the probe)
        model = self.ll.llama_model_load_from_file(os.fsencode(path), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}",
                "the file may be damaged or use an architecture this llama-cpp-python build does "
                "not know; run with --verbose to see llama.cpp's message, or upgrade llama-cpp-python",
            )
        return model

    def free_model(self, model) -> None:
        self.ll.llama_model_free(model)

    def n_vocab(self, model) -> int:
        return int(self.ll.llama_vocab_n_tokens(self.ll.llama_model_get_vocab(model)))

    def n_ctx_train(self, model) -> int:
        return int(self.ll.llama_model_n_ctx_train(model))

    def window(self, model) -> int:
        """The model's sliding window in tokens (0: no sliding-window layers)."""
        n_swa = getattr(self.ll, "llama_model_n_swa", None)
        return int(n_swa(model)) if n_swa is not None else 0

    def recurrent(self, model) -> bool:
        """Whether the model keeps a recurrent state (Mamba-like, or hybrid: Gated DeltaNet
        layers beside attention) whose past positions llama.cpp cannot drop."""
        return any(
            bool(fn(model))
            for fn in (getattr(self.ll, name, None) for name in ("llama_model_is_recurrent", "llama_model_is_hybrid"))
            if fn is not None
        )

    def meta(self, model, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def tokenize(self, model, text: str, add_special: bool = False) -> list[int]:
        vocab = self.ll.llama_model_get_vocab(model)
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        out = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(vocab, raw, len(raw), out, cap, add_special, True)
        if n < 0:  # pragma: no cover - cap is always enough for BPE
            raise ModelLoadError("llama.cpp tokenization failed", "report a bug")
        return list(out[:n])

    # ------------------------------------------------------------------ contexts
    def new_context(
        self,
        model,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        *,
        flash_attn: bool | None = None,
        snapshots: int = 0,
    ):
        """A context of `n_ctx` cells for `n_seq_max` sequences. `flash_attn` None leaves
        llama.cpp's choice (auto: on where supported); False/True force it. `snapshots`: the
        recurrent states llama.cpp keeps per sequence for rolling back that many of the last
        decode's tokens (its n_rs_seq; 0: none)."""
        params = self.ll.llama_context_default_params()
        if snapshots and hasattr(params, "n_rs_seq"):
            params.n_rs_seq = snapshots
        if flash_attn is not None and hasattr(params, "flash_attn_type"):
            params.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        if hasattr(params, "kv_unified"):
            params.kv_unified = True  # branches share prefix cells; seq_cp needs one stream
        if hasattr(params, "no_perf"):
            params.no_perf = True
        ctx = self.ll.llama_init_from_model(model, params)
        if not ctx:
            raise OutOfMemoryError(
                f"llama.cpp could not create a context of {n_ctx} tokens",
                "use fewer prompts or a smaller --max-new-tokens",
            )
        batch = self.ll.llama_batch_init(n_batch, 0, 1)
        self._batches[id(ctx)] = (batch, n_batch)
        return ctx

    def free_context(self, ctx) -> None:
        batch, _ = self._batches.pop(id(ctx), (None, 0))
        if batch is not None:
            self.ll.llama_batch_free(batch)
        self.ll.llama_free(ctx)

    def set_threads(self, ctx, n_threads: int) -> None:
        self.ll.llama_set_n_threads(ctx, n_threads, n_threads)

    # ------------------------------------------------------------------ memory
    def clear(self, ctx) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(ctx), True)

    def seq_rm(self, ctx, seq: int, p0: int, p1: int) -> bool:
        return bool(self.ll.llama_memory_seq_rm(self.ll.llama_get_memory(ctx), seq, p0, p1))

    def seq_pos_min(self, ctx, seq: int) -> int:
        """The lowest position whose cells sequence `seq` holds in every layer (all up to its
        last are there; -1: none). Above 0 only where sliding-window layers let llama.cpp
        reuse a cell outside the window of the only sequence holding it."""
        return int(self.ll.llama_memory_seq_pos_min(self.ll.llama_get_memory(ctx), seq))

    def seq_cp(self, ctx, src: int, dst: int, p0: int, p1: int) -> None:
        self.ll.llama_memory_seq_cp(self.ll.llama_get_memory(ctx), src, dst, p0, p1)

    def seq_state(self, ctx, seq: int, partial: bool = False) -> bytes:
        """Sequence `seq`'s cache cells (keys, values, positions) as llama.cpp saves them;
        `partial`: only its recurrent state (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)."""
        if partial:
            size = self.ll.llama_state_seq_get_size_ext(ctx, seq, _PARTIAL)
            buf = (ctypes.c_uint8 * max(size, 1))()
            written = self.ll.llama_state_seq_get_data_ext(ctx, buf, size, seq, _PARTIAL)
        else:
            size = self.ll.llama_state_seq_get_size(ctx, seq)
            buf = (ctypes.c_uint8 * max(size, 1))()
            written = self.ll.llama_state_seq_get_data(ctx, buf, size, seq)
        return ctypes.string_at(buf, written)  # one copy (slicing the array made a list: 0.65 s for 24 MB)

    def set_seq_state(self, ctx, seq: int, data: bytes, partial: bool = False) -> None:
        """Restore what seq_state saved into sequence `seq` of `ctx` (OutOfMemoryError when
        the context has no room for it); `partial` as seq_state's."""
        buf = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        if partial:
            done = not data or self.ll.llama_state_seq_set_data_ext(ctx, buf, len(data), seq, _PARTIAL)
        else:
            done = not data or self.ll.llama_state_seq_set_data(ctx, buf, len(data), seq)
        if not done:
            raise OutOfMemoryError(
                "llama.cpp could not restore a saved sequence into its context (out of memory)",
                "use a smaller --max-new-tokens",
            )

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        ctx,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        want: Sequence[bool],
        n_vocab: int,
    ) -> np.ndarray:
        """One llama_decode; returns float32 logits [n_wanted, V] in batch order.

        The caller keeps len(tokens) <= the context's n_batch.
        """
        batch, cap = self._batches[id(ctx)]
        n = len(tokens)
        if n > cap:
            raise RuntimeError(f"llama batch of {n} tokens exceeds n_batch {cap}")
        batch.n_tokens = n
        for i in range(n):
            batch.token[i] = tokens[i]
            batch.pos[i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seqs[i]
            batch.logits[i] = 1 if want[i] else 0
        rc = self.ll.llama_decode(ctx, batch)
        if rc == 1:
            raise OutOfMemoryError(
                "llama.cpp found no room in its KV cache for this step (out of memory)",
                "use fewer prompts or a smaller --max-new-tokens",
            )
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        n_out = sum(1 for w in want if w)
        if n_out == 0:
            return np.empty((0, n_vocab), dtype=np.float32)
        ptr = self.ll.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, n_vocab)).copy()
