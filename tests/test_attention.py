"""backends/torch/attention.py: the kernel each step takes and the numbers each path gives.

The batched-matmul path (few query rows over a long span, CUDA) equals the folded
memory-efficient kernel's grouped-query attention in float32, on views of a larger cache
as the model passes them, and an engine forced through it decodes the same tokens; the
lower-right chunk of a long prompt in float32 runs one unmasked call per query group (torch
would otherwise materialise its mask and run the math kernel). Kernel choices and shapes
on fake CUDA tensors; numbers on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssdlocal.backends.torch import attention
from ssdlocal.backends.torch.attention import (
    MATMUL_ROWS,
    MATMUL_SPAN,
    AttentionMask,
    attention_kernel,
    lower_right_attention,
    matmul_attention,
)
from support.fake_cuda import CUDA, fake_cuda

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _reference(q, keys, values, mask):
    """SDPA with a boolean mask and native GQA (what the CPU runs; the folded kernel's numbers)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "T", "span"), [(8, 2, 1, 300), (8, 2, 5, 1024), (12, 2, 4, 700), (4, 4, 3, 64)]
)
def test_batched_matmul_attention_equals_grouped_query_attention(heads, kv_heads, T, span):
    torch.manual_seed(0)
    B, D, slots = 3, 16, span + 200
    cache_k, cache_v = torch.randn(B + 1, kv_heads, slots, D), torch.randn(B + 1, kv_heads, slots, D)
    keys, values = cache_k[:B, :, :span], cache_v[:B, :, :span]  # views, as KVCache.update returns them
    q = torch.randn(B, heads, T, D)
    lengths = torch.tensor([span - T, span // 2, 7])
    positions = lengths[:, None] + torch.arange(T)  # [B, T]
    mask = torch.arange(span)[None, None, :] <= positions[:, :, None]  # [B, T, S] causal
    mask[1, :, 3] = False  # and a hole, as tree masks have
    got = matmul_attention(q, keys, values, ~mask[:, None, None])
    assert torch.allclose(got, _reference(q, keys, values, mask), atol=1e-5, rtol=1e-5)


def test_the_path_is_chosen_per_span_and_rows():
    assert attention_kernel("cuda", masked=True, rows=6, span=MATMUL_SPAN) == "batched-matmul"
    assert attention_kernel("cuda", masked=True, rows=6, span=MATMUL_SPAN - 256) == "efficient-folded"
    assert attention_kernel("cuda", masked=True, rows=MATMUL_ROWS + 1, span=32768) == "efficient-folded"  # a tree
    assert attention_kernel("cuda", masked=False, rows=6, span=32768) == "flash-causal"
    assert attention_kernel("cpu", masked=True, rows=6, span=32768) == "cpu-flash"
    with fake_cuda():
        for span, kernel in ((1024, "efficient-folded"), (8192, "batched-matmul"), (32768, "batched-matmul")):
            built = AttentionMask.build(torch.zeros(1, 5, span, dtype=torch.bool, device=CUDA), 6, torch.bfloat16)
            assert built.kernel == kernel, span
        assert built.tensor.shape == (1, 1, 1, 5, 32768) and built.tensor.dtype == torch.bool


def test_a_long_span_step_on_cuda_runs_the_batched_matmuls(monkeypatch):
    """A Qwen2-shaped decode and verify over 8,192 slots on fake CUDA: the model's masked
    steps take the matmul path with float32 scores (bmm's out_dtype), no K/V copy."""
    from ssdlocal.backends.torch.models import build, causal_mask
    from support.fake_cuda import llama_args, to_fake_cuda

    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(attention.torch, "bmm", lambda *a, **k: calls.append(k.get("out_dtype")) or real_bmm(*a, **k))
    args = llama_args("qwen2", num_heads=12, max_position_embeddings=16384)
    with fake_cuda():
        model = to_fake_cuda(build(args), torch.bfloat16)
        model.setup_cache(1, 8192, torch.bfloat16, CUDA)
        pos = torch.full((1, 5), 8000, device=CUDA) + torch.arange(5, device=CUDA)
        out = model(torch.zeros(1, 5, dtype=torch.long, device=CUDA), pos, pos, causal_mask(pos, 8192))
    assert out.shape == (1, 5, 320) and out.dtype == torch.float32
    assert calls == [torch.float32, None] * 2  # scores in float32, then probabilities x values; per layer


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_engine_forced_through_the_matmul_path_decodes_the_same_tokens(tiny_dir, monkeypatch, arch):
    """Every masked step (decode, verify, a draft's steps) through the batched matmuls on the
    CPU, float32 greedy: the same tokens as the default kernel, in AR and SD."""
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine
    from support.drafts import draft_of

    prompts = ["hello world, def foo(x):", "the cat sat on the mat"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    draft = draft_of(str(tiny_dir[f"draft_{arch}"]), suffix=False)
    specs = [SpecConfig(mode=Mode.AR), SpecConfig(mode=Mode.SD, k=3, draft=draft)]
    config = EngineConfig(target=ModelSpec(str(tiny_dir[arch]), dtype="float32"), spec=specs[1], pin_cpus=False)

    def tokens(engine):
        out = []
        for spec in specs:
            done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
            out.append([o.token_ids for o in done.outputs])
        return out

    with Engine(config) as engine:
        want = tokens(engine)
        used = []
        real = attention.matmul_attention
        monkeypatch.setattr(attention, "matmul_attention", lambda *a: used.append(1) or real(*a))
        monkeypatch.setattr(
            attention,
            "attention_kernel",
            lambda device, masked, rows=1, span=0: "batched-matmul" if masked else "cpu-flash",
        )
        got = tokens(engine)
    assert got == want and want[0] == want[1]
    assert used


def test_a_float32_lower_right_chunk_runs_one_unmasked_call_per_query_group(monkeypatch):
    """On CUDA in float32 flash is out and the memory-efficient kernel takes no GQA, so a
    chunk of a long prompt with GQA would have torch materialise its lower-right mask and
    run the math kernel, per layer and chunk; instead every call has as many query heads
    as kv heads (no enable_gqa: the efficient kernel's own lower-right causal mode)."""
    seen = []

    def sdpa(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        seen.append((q.shape[1], k.shape[1], enable_gqa, q.dtype))
        return torch.empty_like(q)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    import torch.nn.attention.bias as bias_mod

    monkeypatch.setattr(bias_mod, "causal_lower_right", lambda T, S: ("lower right", T, S))
    with fake_cuda():
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.zeros(2, 8, 16, 32, dtype=dtype, device=CUDA)
            kv = torch.zeros(2, 2, 512, 32, dtype=dtype, device=CUDA)
            out = lower_right_attention(q, kv, kv, (100, 100))
            assert out.shape == (2, 8, 16, 32)
    fp32 = [s for s in seen if s[3] == torch.float32]
    assert len(fp32) == 4 and all(h == kv and not gqa for h, kv, gqa, _ in fp32)  # G = 4 calls
    assert [s[:3] for s in seen if s[3] == torch.bfloat16] == [(8, 2, True)]  # flash takes GQA as it is


def test_the_grouped_lower_right_chunk_equals_the_masked_one():
    """The per-group calls give the numbers of one masked call with GQA (CPU, float32)."""
    torch.manual_seed(1)
    q, keys, values = torch.randn(3, 8, 6, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    spans = (30, 30, 40)
    got = lower_right_attention(q, keys, values, spans)
    for b, S in enumerate(spans):
        visible = torch.arange(S)[None, :] <= torch.arange(S - 6, S)[:, None]  # [T, S] lower right
        want = _reference(q[b : b + 1], keys[b : b + 1, :, :S], values[b : b + 1, :, :S], visible[None])
        assert torch.allclose(got[b : b + 1], want, atol=1e-5)
