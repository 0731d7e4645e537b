"""Reading long prompts: chunks layer by layer, quantized weights expanded to dense ones.

The expansion must give exactly the weights the quantized kernels multiply by (float32;
bfloat16 within its rounding) for every CPU int4 layout torch may use, and a long feed
(chunked, expanded) must give the logits of one plain forward over the same tokens; a
progress callback that raises stops the feed with nothing held.
"""

from __future__ import annotations


import pytest
import torch

from ssdlocal.backends.torch import int4_cpu
from ssdlocal.backends.torch import runner as runner_mod
from ssdlocal.backends.torch.quant import QuantLinear, quantize
from ssdlocal.core.config import EngineConfig, ModelSpec, SamplingParams
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from support.host_reads import HostReads

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.mark.parametrize("layout", int4_cpu.LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("rows", [128, 176])  # whole blocks only, and a partial last block
def test_expansion_equals_the_int4_values_in_every_layout(layout, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, 96, generator=gen)
    qw = quantize(w, "int4", torch.float32)
    packed = int4_cpu.pack(qw.codes, layout)
    sz = torch.stack((qw.scales.t(), qw.zeros.t()), dim=-1).contiguous()  # [K/g, N, 2] as QuantLinear packs
    exact = qw.dequantize(torch.float32)  # [N, K]
    got = int4_cpu.expand_transposed(packed, sz, qw.group_size, layout, torch.float32)  # [K, N]
    assert torch.allclose(got.t(), exact, atol=1e-6, rtol=0)
    half = int4_cpu.expand_transposed(packed, sz.bfloat16(), qw.group_size, layout, torch.bfloat16)
    step = exact.abs().amax() / 64  # a few bfloat16 steps of the largest weights
    assert (half.t().float() - exact).abs().max() < step


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_expanded_linear_equals_its_kernel(scheme, dtype):
    gen = torch.Generator().manual_seed(3)
    linear = QuantLinear(quantize(torch.randn(200, 128, generator=gen), scheme, dtype), None, dtype=dtype, device="cpu")
    x = torch.randn(300, 128, generator=gen).to(dtype)
    kernel = linear(x).float()
    with linear.expanded():
        assert linear._dense is not None
        dense = linear(x).float()
    assert linear._dense is None  # released on exit
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (dense - kernel).abs().max() <= tol * kernel.abs().max()


@pytest.fixture(scope="module")
def long_context(tiny_dir, tmp_path_factory):
    """The tiny llama with a 4096-token context."""
    from support.tiny_models import copy_with_context

    return str(copy_with_context(tiny_dir["llama"], tmp_path_factory.mktemp("long") / "llama", 4096))


def _last_logits(engine: Engine, ids: list[list[int]]) -> torch.Tensor:
    runner = engine.runner
    runner.reset(len(ids), max(map(len, ids)) + 8)
    return torch.stack([lg[-1] for lg in runner.feed(ids, "last")])  # [B, V]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_a_chunked_expanded_feed_equals_one_plain_forward(long_context, quantization, monkeypatch):
    spec = ModelSpec(long_context, dtype="float32", quantization=quantization)
    prompts = [[(7 * i) % 300 + 5 for i in range(1300)], [(11 * i) % 300 + 5 for i in range(777)]]
    expanded = []
    real = runner_mod.dense_dtype

    def always_dense(model, rows):  # whatever the timings say for tiny matrices
        expanded.append(real(model, rows))
        return torch.float32 if quantization != "none" else None

    monkeypatch.setattr(runner_mod, "dense_dtype", always_dense)
    with Engine(EngineConfig(target=spec, prefix_cache_tokens=0)) as engine:
        chunked = _last_logits(engine, prompts)  # 1300 tokens: 3 chunks of 512, expanded weights
        assert expanded and (expanded[0] is None) == (quantization == "none")  # nothing to expand
        monkeypatch.setattr(runner_mod, "PREFILL_CHUNK", 1 << 20)
        monkeypatch.setattr(runner_mod, "DENSE_MIN_TOKENS", 1 << 30)
        plain = _last_logits(engine, prompts)  # one forward through the quantized kernels
    assert torch.allclose(chunked, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(chunked.argmax(-1), plain.argmax(-1))


def test_the_path_for_long_feeds_is_chosen_by_measured_cost():
    from ssdlocal.backends.torch.prefill_path import PathCosts

    costs = PathCosts(kernel_per_row=3e-4, dense={torch.bfloat16: (1e-4, 0.02), torch.float32: (2e-4, 0.001)})
    assert costs.best(5) is None  # a few rows: the kernel (expanding costs more than it saves)
    assert costs.best(50) == torch.float32  # cheap expansion wins first
    assert costs.best(1000) == torch.bfloat16  # many rows: the fastest matmul
    slow = PathCosts(kernel_per_row=1e-4, dense={torch.bfloat16: (2.3e-4, 0.02)})  # an AVX2-only CPU's bf16
    assert slow.best(10_000) is None


def test_the_measured_choice_is_taken_once_per_process_and_shape(tiny_dir):
    from ssdlocal.backends.torch import prefill_path

    spec = ModelSpec(str(tiny_dir["llama"]), dtype="bfloat16", quantization="int4")
    with Engine(EngineConfig(target=spec, prefix_cache_tokens=0)) as engine:
        prefill_path._MEASURED.clear()
        first = prefill_path.dense_dtype(engine.runner.model, 512)
        assert len(prefill_path._MEASURED) == 1
        (costs,) = prefill_path._MEASURED.values()
        assert costs.kernel_per_row > 0 and set(costs.dense) == {torch.bfloat16, torch.float32}
        assert prefill_path.dense_dtype(engine.runner.model, 512) == first and len(prefill_path._MEASURED) == 1
        assert first in (None, torch.bfloat16, torch.float32)
    with Engine(EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"))) as engine:
        assert prefill_path.dense_dtype(engine.runner.model, 512) is None  # nothing quantized


def test_a_raising_progress_stops_the_feed_and_holds_nothing(long_context):
    seen = []

    def stop_after_first(done, total):
        seen.append((done, total))
        raise KeyboardInterrupt

    prompt = [(3 * i) % 300 + 5 for i in range(1500)]
    with Engine(EngineConfig(target=ModelSpec(long_context, dtype="float32"), prefix_cache_tokens=0)) as engine:
        runner = engine.runner
        runner.reset(1, 1600)
        with pytest.raises(KeyboardInterrupt):
            runner.feed([prompt], "last", stop_after_first)
        layers = len(runner.model.layers)  # read layer by layer: a chunk of one layer is 1/layers of its tokens
        assert seen == [(512 // layers, 1500)] and runner.cached(0) == 0
        again = runner.feed([prompt], "last")[0][-1]  # the next feed starts from scratch
        runner.reset(1, 1600)
        fresh = runner.feed([prompt], "last")[0][-1]
    assert torch.equal(again, fresh)


def test_cancel_while_a_long_prompt_is_read_stops_within_a_chunk(long_context):
    from ssdlocal.core.cancel import CancelToken

    token = CancelToken()
    progress = []

    def on_progress(p):
        progress.append((p.done, p.total))
        token.cancel()  # as a client disconnect or Esc would, from another thread

    prompt = [(5 * i) % 300 + 5 for i in range(1500)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(EngineConfig(target=ModelSpec(long_context, dtype="float32"))) as engine:
        events = list(engine.generate([prompt], params, cancel=token, progress=on_progress))
        assert progress == [(512 // len(engine.runner.model.layers), 1500)]  # the next report saw the cancel
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.outputs[0].finish_reason == "cancelled"
        assert done.outputs[0].token_ids == ()
        assert engine.prefix_reports()["target"]["used_tokens"] == 0  # nothing half-read was kept
        full = [e for e in engine.generate([prompt], params) if isinstance(e, DoneEvent)][0]
        assert len(full.outputs[0].token_ids) == 4


def _two_feeds(engine: Engine) -> torch.Tensor:
    """Rows of 300 and 500 tokens, then 1300 more tokens each (3 chunks from unequal starts)."""
    runner = engine.runner
    runner.reset(2, 2200)
    runner.feed([[(3 * i) % 300 + 5 for i in range(300)], [(5 * i) % 300 + 5 for i in range(500)]], "none")
    more = [[(7 * i) % 300 + 5 for i in range(1300)], [(11 * i) % 300 + 5 for i in range(1300)]]
    return torch.stack([lg[-1] for lg in runner.feed(more, "last")])  # [B, V]


def test_a_chunked_feed_reads_nothing_back_and_the_lower_right_kernel_agrees(long_context, monkeypatch):
    from ssdlocal.backends.torch.models import base as model_mod

    reads = HostReads(monkeypatch)
    with Engine(EngineConfig(target=ModelSpec(long_context, dtype="float32"), prefix_cache_tokens=0)) as engine:
        real = engine.runner.model.prefill

        def watched(*a, **k):
            reads.active = True
            try:
                return real(*a, **k)
            finally:
                reads.active = False

        monkeypatch.setattr(engine.runner.model, "prefill", watched)
        masked = _two_feeds(engine)
        assert reads.count == 0  # no host wait per (layer, chunk): spans come from host starts
        monkeypatch.setattr(model_mod, "chunk_kernel", lambda device_type: "lower-right")  # CUDA's choice
        causal = _two_feeds(engine)
        assert reads.count == 0
    assert torch.allclose(causal, masked, atol=1e-5, rtol=1e-5)
    assert torch.equal(causal.argmax(-1), masked.argmax(-1))


def test_a_chunks_mask_is_built_once_for_every_layer(long_context, monkeypatch):
    from ssdlocal.backends.torch.models import base as model_mod

    built = []
    real = model_mod.causal_mask
    monkeypatch.setattr(model_mod, "causal_mask", lambda pos, span: built.append(span) or real(pos, span))
    with Engine(EngineConfig(target=ModelSpec(long_context, dtype="float32"), prefix_cache_tokens=0)) as engine:
        layers = len(engine.runner.model.layers)
        kept = _two_feeds(engine)
        assert len(built) == 1 + 3  # the first feed's one chunk, then the second feed's three
        built.clear()
        monkeypatch.setattr(model_mod, "MASK_CACHE_BYTES", 0)  # too long a prompt to keep them
        rebuilt = _two_feeds(engine)
        assert len(built) == layers * (1 + 3)
    assert torch.equal(kept, rebuilt)


def test_a_feed_whose_rows_start_far_apart_pads_past_num_slots_and_keeps_every_rows_logits(tiny_dir):
    """A row that holds many tokens and feeds one (a carried row after a prefix-cache hit)
    beside a row that feeds a whole prompt: every row is padded to the longest feed, past
    num_slots though each row's own tokens fit. The runner makes room for the pads, and
    each row's logits are what it gets fed alone."""
    held = [(3 * i) % 300 + 5 for i in range(200)]
    prompt = [(7 * i) % 300 + 5 for i in range(150)]
    with Engine(EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), prefix_cache_tokens=0)) as e:
        runner = e.runner
        runner.reset(2, 210)  # each row's tokens fit: 201 and 150; the padded feed writes up to slot 349
        runner.feed([held, []], "none")
        both = runner.feed([[9], prompt], "last")
        assert runner.cached(0) == 201 and runner.cached(1) == 150
        runner.reset(1, 210)
        runner.feed([held], "none")
        alone_carried = runner.feed([[9]], "last")[0]
        runner.reset(1, 210)
        alone_new = runner.feed([prompt], "last")[0]
    torch.testing.assert_close(both[0], alone_carried, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], alone_new, rtol=1e-5, atol=1e-5)
