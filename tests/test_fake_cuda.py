"""The CUDA code path on fake CUDA tensors (no GPU needed): shapes, dtypes and op schemas.

Runs in the default CPU suite. Every tensor here says device="cuda", so the code takes
its CUDA branches: the fused-attention mask with GQA folded into the queries, the
float32 lm_head matmul, tinygemm int4 and the int8 linears, the runner's decode and
tree steps, the q channel's CUDA buffer and the speculator's q on the draft's device.
What a GPU would reject for a wrong shape, dtype or schema fails here too; numbers are
checked by the `gpu` tests and scripts/gpu_accept.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.fake_cuda import CUDA, fake_cuda, llama_args, to_fake_cuda
from ssdlocal.backends.torch import attention
from ssdlocal.backends.torch.models import causal_mask
from ssdlocal.backends.torch.models.llama import Llama

BF16 = torch.bfloat16


@pytest.fixture
def kernels(monkeypatch):
    """The attention kernels the forward called, in order."""
    seen: list[str] = []
    real_folded, real_sdpa = attention.folded_attention, attention.F.scaled_dot_product_attention

    def folded(*a, **k):
        seen.append("efficient-folded")
        return real_folded(*a, **k)

    def sdpa(*a, **k):
        if k.get("is_causal"):
            seen.append("flash-causal")
        return real_sdpa(*a, **k)

    monkeypatch.setattr(attention, "folded_attention", folded)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forward_prefill_decode_and_tree_on_cuda(arch, kernels):
    model = Llama(llama_args(arch))
    with fake_cuda():
        model = to_fake_cuda(model, BF16)
        model.setup_cache(2, 512, BF16, CUDA)
        ids = torch.zeros(2, 7, dtype=torch.long, device=CUDA)
        pos = torch.arange(7, device=CUDA).unsqueeze(0).expand(2, 7)
        prefill = model(ids, pos, pos, None, torch.full((2, 1), 6, device=CUDA))  # last only
        step = model(ids[:, :5], pos[:, :5] + 7, pos[:, :5] + 7, causal_mask(pos[:, :5] + 7, 256))
        tree_mask = torch.zeros(2, 16, 512, dtype=torch.bool, device=CUDA)  # 16 branches
        tree = model(ids[:, :1].expand(2, 16), pos[:, :1].expand(2, 16), pos[:, :1].expand(2, 16), tree_mask)
    assert (prefill.shape, prefill.dtype, prefill.device) == ((2, 1, 320), torch.float32, CUDA)
    assert (step.shape, step.dtype) == ((2, 5, 320), torch.float32)
    assert tree.shape == (2, 16, 320) and tree.dtype == torch.float32
    assert kernels == ["flash-causal"] * 2 + ["efficient-folded"] * 4  # 2 layers per forward


def test_the_kernel_namer():
    assert attention.attention_kernel("cuda", masked=True) == "efficient-folded"
    assert attention.attention_kernel("cuda", masked=False) == "flash-causal"
    assert attention.attention_kernel("cpu", masked=True) == "cpu-flash"
    with fake_cuda():
        mask = torch.zeros(1, 3, 256, dtype=torch.bool, device=CUDA)
        built = attention.AttentionMask.build(mask, 4, BF16)
    assert built.kernel == "efficient-folded" and built.tensor.shape == (1, 1, 12, 256)
    assert built.tensor.dtype == BF16  # an additive mask in the activation dtype
    cpu = attention.AttentionMask.build(torch.zeros(1, 3, 256, dtype=torch.bool), 4, BF16)
    assert cpu.kernel == "cpu-flash" and cpu.tensor.dtype == torch.bool


def test_folded_attention_equals_grouped_query_attention():
    """The folding itself, computed on the CPU: the same numbers as SDPA's enable_gqa."""
    torch.manual_seed(0)
    q, keys, values = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.rand(2, 3, 40) > 0.3
    mask[..., 0] = True  # every query sees a slot
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
    rows = mask[:, None].expand(2, 4, 3, 40).reshape(2, 1, 12, 40)
    bias = torch.zeros(rows.shape).masked_fill_(~rows, float("-inf"))
    assert torch.allclose(attention.folded_attention(q, keys, values, bias), want, atol=1e-6)


def test_runner_feed_and_steps_on_cuda():
    from ssdlocal.backends.torch.loader import LoadedModel
    from ssdlocal.backends.torch.runner import TorchRunner

    args = llama_args("qwen2")
    model = Llama(args)
    with fake_cuda():
        model = to_fake_cuda(model, BF16)
        loaded = LoadedModel(model, None, args, None, None, CUDA, BF16, (0,))
        runner = TorchRunner(loaded, graphs="off")
        runner.reset(2, 300)
        fed = runner.feed([[1, 2, 3], [4, 5]], "last")
        runner.begin_steps()
        logits = runner.step(torch.zeros(2, 5, dtype=torch.long, device=CUDA), bound=10)
        runner.advance(torch.ones(2, dtype=torch.long, device=CUDA))
        tree = runner.forward_raw(
            *(torch.zeros(2, 4, dtype=torch.long, device=CUDA),) * 3,
            torch.ones(2, 4, 512, dtype=torch.bool, device=CUDA),
        )
    assert [f.shape for f in fed] == [(1, 320), (1, 320)]
    assert logits.shape == (2, 5, 320) and logits.dtype == torch.float32
    assert tree.shape == (2, 4, 320)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(96, 64), (40, 256), (512, 128)])
def test_quantized_linears_on_cuda(scheme, shape, monkeypatch):
    from ssdlocal.backends.torch import int4_cuda, quant
    from ssdlocal.backends.torch.quant import QuantLinear, quantize

    monkeypatch.setattr(quant, "int8_cuda_kernel", lambda: True)  # a CUDA build has it
    monkeypatch.setattr(int4_cuda, "layout_known", lambda device, tiles: True)  # checked on a GPU
    n, k = shape
    qw = quantize(torch.randn(n, k), scheme, BF16)
    with fake_cuda():
        layer = QuantLinear(qw, None, dtype=BF16, device=CUDA)
        out = layer(torch.zeros(3, 5, k, dtype=BF16, device=CUDA))
        rows = layer.dequantize_rows(torch.zeros(3, 2, dtype=torch.long, device=CUDA))
        with layer.expanded():  # a long prompt's dense weight, once per layer
            dense = layer._dense
            long = layer(torch.zeros(600, k, dtype=BF16, device=CUDA))
    assert layer.kernel == f"{scheme}_cuda"
    assert out.shape == (3, 5, n) and out.dtype == BF16
    assert rows.shape == (3, 2, k) and rows.dtype == torch.float32  # for the float32 refinement
    assert (dense.shape, dense.dtype) == ((n, k), BF16) and long.shape == (600, n)
    if scheme == "int8":
        assert layer.codes.dtype == torch.int8  # one byte per weight on CUDA too
    else:
        assert layer.packed.dtype == torch.int32 and not hasattr(layer, "codes")  # tinygemm's layout only


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int4_on_cuda_takes_bfloat16_only(dtype):
    from ssdlocal.backends.torch.quant import QuantLinear, quantize
    from ssdlocal.core.errors import UsageError

    qw = quantize(torch.randn(64, 128), "int4", dtype)
    with fake_cuda(), pytest.raises(UsageError) as err:
        QuantLinear(qw, None, dtype=dtype, device=CUDA)  # never a float W per forward
    assert "bfloat16" in err.value.message and "--dtype bfloat16" in err.value.hint


def test_int8_on_cuda_without_torchs_kernel_is_refused(monkeypatch):
    from ssdlocal.backends.torch import quant
    from ssdlocal.core.errors import UsageError

    monkeypatch.setattr(quant, "int8_cuda_kernel", lambda: False)
    with fake_cuda(), pytest.raises(UsageError) as err:
        quant.QuantLinear(quant.quantize(torch.randn(64, 128), "int8", BF16), None, dtype=BF16, device=CUDA)
    assert "_weight_int8pack_mm" in err.value.message and "int4" in err.value.hint


def test_float32_logits_on_cuda(monkeypatch):
    from ssdlocal.backends.torch import quant
    from ssdlocal.backends.torch.logits import fp32_logits
    from ssdlocal.backends.torch.quant import QuantLinear, quantize

    monkeypatch.setattr(quant, "int8_cuda_kernel", lambda: True)  # a CUDA build has it

    head = torch.nn.Linear(64, 300, bias=False)
    qhead = QuantLinear(quantize(torch.randn(300, 64), "int8", BF16), None, dtype=BF16, device="cpu")
    with fake_cuda():
        head = to_fake_cuda(head, BF16)
        h = torch.zeros(2, 3, 64, dtype=BF16, device=CUDA)
        dense = fp32_logits(head, h)  # torch.mm(..., out_dtype=float32)
        qhead = QuantLinear(quantize(torch.randn(300, 64), "int8", BF16), None, dtype=BF16, device=CUDA)
        quant = fp32_logits(qhead, h)  # refined from the de-quantized rows
    assert (dense.shape, dense.dtype, dense.device) == ((2, 3, 300), torch.float32, CUDA)
    assert (quant.shape, quant.dtype) == ((2, 3, 300), torch.float32)


def test_q_channel_and_speculator_q_stay_on_the_gpu(monkeypatch):
    from ssdlocal.core.config import SamplingParams
    from ssdlocal.draft.ssd.speculator import RowState, Speculator
    from ssdlocal.ipc.qchannel import QChannel, write_q

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with fake_cuda():
        channel = QChannel("cuda-ipc", 2, 4, 300, "cuda:0")
        spec = object.__new__(Speculator)  # only what _backup / _served read
        spec.k, spec.vocab, spec.params = 4, 300, SamplingParams(temperature=1.0)
        spec.runner = SimpleNamespace(device=CUDA)
        spec.rows = [RowState([1, 2, 3], [], None, {}), RowState([1, 2], [], None, {})]
        spec._backup([0, 1], "ngram")  # point masses for the n-gram backup's proposals
        served = spec._served([False, False], "ngram")
        write_q(channel.buffer, served.q)
        q = channel.read("cuda:0")
    assert served.q.device == CUDA and served.q.shape == (2, 4, 300)
    assert channel.buffer.device == CUDA and q.device == CUDA and q.shape == (2, 4, 300)
