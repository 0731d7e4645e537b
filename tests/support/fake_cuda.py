"""Fake CUDA tensors on a machine without CUDA: shapes, dtypes and op schemas of the GPU path.

`FakeTensorMode` gives tensors that say `device="cuda"` and dispatch every aten op to its
fake (meta) implementation, so code that branches on `is_cuda` takes its CUDA branch and
CUDA-only ops (tinygemm int4, `mm(out_dtype=float32)`, ...) check their arguments. A CPU
build of torch cannot run Python indexing (`t[...]`, `t[...] = v`) and a few other
bindings on such tensors (they ask for a CUDA device guard), so `fake_cuda()` answers
those calls itself: the result's shape, strides and dtype come from the same call on
meta tensors (the values of fake tensors are never read).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda:0")


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    if isinstance(value, list):
        return [_meta(v) for v in value]
    return value


def _cuda_like(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=CUDA)
    if isinstance(value, (tuple, list)):
        return type(value)(_cuda_like(v) for v in value)
    return value


class _GuardFree(TorchFunctionMode):
    """Calls that a CPU build refuses on fake CUDA tensors (Python indexing and a few other
    bindings ask for a CUDA device guard) are answered from meta tensors of the same layout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
        with torch._C.DisableTorchFunction():
            out = func(*_meta(args), **{k: _meta(v) for k, v in kwargs.items()})
            return _cuda_like(out)


@contextlib.contextmanager
def fake_cuda():
    """Inside: tensors made with device="cuda" are fake; yields the FakeTensorMode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _GuardFree():
        yield mode


def to_fake_cuda(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace a (real, CPU) module's parameters and buffers by fake CUDA tensors of the same
    shapes, in `dtype` where they are floating point (tied tensors stay tied). Call inside
    `fake_cuda()`."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    want = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    fake = torch.empty(t.shape, dtype=want, device=CUDA)
                    made[id(t)] = nn.Parameter(fake, requires_grad=False) if isinstance(t, nn.Parameter) else fake
                store[name] = made[id(t)]
    return module


def llama_args(arch: str, **changes):
    """Args of a small llama-block model (`arch`: llama, qwen2 or qwen3, with that
    family's biases and norms) for fake-CUDA shape tests; `changes` override fields."""
    from ssdlocal.backends.torch.models.llama import LlamaArgs

    base = dict(
        arch=arch,
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=arch != "llama",
        max_position_embeddings=512,
    )
    return LlamaArgs(**{**base, **changes})
