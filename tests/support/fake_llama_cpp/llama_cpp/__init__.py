"""A fake llama-cpp-python for the probe tests: the C-API names LlamaLib calls, with a
native-library failure chosen by the environment (FAKE_LLAMA_CPP):

- ok: every call works (logits are a fixed function of the token);
- segv / abort: the first llama_decode kills the process (SIGSEGV, SIGABRT), as a
  crashing native kernel would;
- repack-segv: SIGSEGV only when the model was loaded with use_extra_bufts on;
- repack-hang: never returns from llama_decode when use_extra_bufts is on;
- no-switch: like segv, and llama_model_params has no use_extra_bufts (old releases).

`Llama(**kwargs)` stands in for the high-level class: it records the default model params
it was built with (`self.extra_bufts`). Each model load appends "load extra_bufts=<bool>" to $FAKE_LLAMA_CPP_LOG when set.
Put the folder holding this package first on PYTHONPATH (the probe's child inherits it).
"""

import ctypes
import os
import signal
import logging
import sys
import time

__version__ = "0.0.fake"

MODE = os.environ.get("FAKE_LLAMA_CPP", "ok")
N_VOCAB = 320
LLAMA_SPLIT_MODE_NONE = 0
llama_token = ctypes.c_int32


class llama_model_params:  # noqa: N801 - llama.cpp's name
    n_gpu_layers = 0
    main_gpu = 0
    split_mode = 1
    if MODE != "no-switch":
        use_extra_bufts = True


class _Params:
    pass


class _Model:
    def __init__(self, extra_bufts):
        self.extra_bufts = extra_bufts


class _Batch:
    def __init__(self, n):
        self.n_tokens = 0
        self.token = [0] * n
        self.pos = [0] * n
        self.n_seq_id = [0] * n
        self.seq_id = [[0] for _ in range(n)]
        self.logits = [0] * n


class _Context:
    def __init__(self, model):
        self.model = model
        self.out = None


def _crash(sig):
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from a test
    except (ImportError, ValueError, OSError):
        pass
    if sig == signal.SIGABRT:
        os.abort()
    os.kill(os.getpid(), sig)
    time.sleep(10)


def llama_backend_init():
    pass


def llama_supports_gpu_offload():
    return False


def llama_max_parallel_sequences():
    return 64


def llama_model_default_params():
    params = llama_model_params()
    if MODE != "no-switch":
        params.use_extra_bufts = True
    return params


def llama_model_load_from_file(path, params):
    extra = getattr(params, "use_extra_bufts", True)
    if os.environ.get("FAKE_LLAMA_CPP_LOG"):
        with open(os.environ["FAKE_LLAMA_CPP_LOG"], "a") as fh:
            fh.write(f"load extra_bufts={extra}\n")
    return _Model(extra)


def llama_model_free(model):
    pass


def llama_model_get_vocab(model):
    return model


def llama_vocab_n_tokens(vocab):
    return N_VOCAB


def llama_context_default_params():
    return _Params()


def llama_init_from_model(model, params):
    return _Context(model)


def llama_batch_init(n, embd, n_seq):
    return _Batch(n)


def llama_batch_free(batch):
    pass


def llama_free(ctx):
    pass


def llama_decode(ctx, batch):
    repacked = ctx.model.extra_bufts
    if MODE in ("segv", "no-switch") or (MODE == "repack-segv" and repacked):
        _crash(signal.SIGSEGV)
    if MODE == "abort":
        _crash(signal.SIGABRT)
    if MODE == "repack-hang" and repacked:
        time.sleep(3600)
    want = [i for i in range(batch.n_tokens) if batch.logits[i]]
    out = (ctypes.c_float * (len(want) * N_VOCAB))()
    for row, i in enumerate(want):
        out[row * N_VOCAB + (batch.token[i] * 7 + 3) % N_VOCAB] = 1.0
    ctx.out = out
    return 0


def llama_get_logits(ctx):
    return ctypes.cast(ctx.out, ctypes.POINTER(ctypes.c_float))


class Llama:
    """llama-cpp-python's high-level class reads its defaults from `llama_cpp.llama_cpp`."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.extra_bufts = llama_cpp.llama_model_default_params().use_extra_bufts
        # the real one: set_verbose(verbose), i.e. DEBUG, or ERROR when verbose=False
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if kwargs.get("verbose", True) else logging.ERROR)


llama_cpp = sys.modules[__name__]  # the real package's low-level submodule
