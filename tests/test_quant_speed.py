"""backends/torch/quant_speed.py: int8/int4 on CUDA timed against dense weights at the step
shapes before a model loads, refused with the numbers where they lose and the dense weights
fit. The projections run on fake CUDA tensors (the kernels' schemas: tinygemm int4 and
torch's int8 kernel), timed by a scripted timer; the decision is checked both ways."""

from __future__ import annotations

import pytest
import torch

from ssdlocal.backends.torch import int4_cuda, quant, quant_speed
from ssdlocal.core.errors import UsageError
from support.fake_cuda import CUDA, fake_cuda, llama_args

BF16 = torch.bfloat16
ARGS = llama_args("qwen2")


@pytest.fixture(autouse=True)
def tiny_is_timed(monkeypatch):
    monkeypatch.setattr(quant_speed, "MIN_DENSE_BYTES", 0)  # these shapes stand for a large model's


@pytest.fixture(autouse=True)
def cuda_kernels(monkeypatch):
    monkeypatch.setattr(quant, "int8_cuda_kernel", lambda: True)  # a CUDA build has it
    monkeypatch.setattr(int4_cuda, "layout_known", lambda device, tiles: True)  # checked on a GPU


def scripted(quantized_ms: float, dense_ms: float):
    """A timer that runs each timed call once (on fake CUDA) and answers scripted seconds:
    the quantized projections first, then the dense ones, for each step row count."""
    calls = []

    def timer(fn, device) -> float:
        outs = fn()
        assert all(o.device == CUDA and o.dtype == BF16 for o in outs)
        calls.append(outs)
        return (quantized_ms if len(calls) % 2 else dense_ms) / 1e3

    return timer, calls


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_kernel_slower_than_dense_is_refused_with_its_timings(scheme):
    timer, calls = scripted(quantized_ms=0.9, dense_ms=0.3)
    with fake_cuda(), pytest.raises(UsageError) as err:
        quant_speed.check_quant_speed(ARGS, scheme, CUDA, BF16, timer=timer)
    assert f"{scheme} weights would run slower than bfloat16" in err.value.message
    assert "0.900 vs 0.300 ms at 1 row" in err.value.message and "at 5 rows" in err.value.message
    assert "--quantization none" in err.value.hint
    assert len(calls) == 2 * len(quant_speed.STEP_ROWS)
    shapes = [tuple(o.shape) for o in calls[0]]  # the MLP's gate/up and down at 1 row
    assert shapes == [(1, ARGS.intermediate_size), (1, ARGS.hidden_size)]


def test_a_kernel_that_pays_is_kept():
    timer, _ = scripted(quantized_ms=0.2, dense_ms=0.3)
    with fake_cuda():
        quant_speed.check_quant_speed(ARGS, "int4", CUDA, BF16, timer=timer)  # no error


def test_a_slower_kernel_is_kept_where_the_dense_weights_would_not_fit(monkeypatch):
    from ssdlocal.backends.torch import kvcache

    monkeypatch.setattr(kvcache, "free_bytes", lambda device: quant_speed.dense_bytes(ARGS, BF16) // 2)
    timer, _ = scripted(quantized_ms=0.9, dense_ms=0.3)
    with fake_cuda():
        quant_speed.check_quant_speed(ARGS, "int8", CUDA, BF16, timer=timer)  # kept: the memory is needed


def test_nothing_is_timed_off_cuda_without_quantization_or_for_a_small_model(monkeypatch):
    def never(fn, device):
        raise AssertionError("timed")

    quant_speed.check_quant_speed(ARGS, "int8", torch.device("cpu"), BF16, timer=never)
    quant_speed.check_quant_speed(ARGS, "none", CUDA, BF16, timer=never)
    monkeypatch.setattr(quant_speed, "MIN_DENSE_BYTES", 64 << 20)
    quant_speed.check_quant_speed(ARGS, "int8", CUDA, BF16, timer=never)  # launch-bound: not timed


def test_dense_bytes_counts_the_config():
    layer = 256 * 32 * (2 * 8 + 2 * 2) + 3 * 256 * 512
    assert quant_speed.dense_bytes(ARGS, BF16) == 2 * (2 * layer + 320 * 256)  # tied embeddings
