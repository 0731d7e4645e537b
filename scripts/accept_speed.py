"""The speed steps of scripts/gpu_accept.py: attention over long spans by both masked-step
paths, and int8 / int4 weights against dense ones, each beside its bandwidth limit.

- `attention_spans`: one decode step (T=1) and one K+1 verify of a model at spans of 1k, 8k
  and 32k slots, through the folded memory-efficient kernel ("efficient-folded") and the
  batched matmuls ("batched-matmul", backends/torch/attention.py), each against the
  bandwidth limit of the bytes the step must read (its weights plus the K/V of the span),
  and the two paths compared in float32 on the device at each span (q, K, V random;
  exact: within 1e-5, as tests/test_attention.py holds them on the CPU).
- `quant_speed`: the same model's steps with bf16, int8 and int4 weights (quantized on the
  device where the model is), each against the bandwidth limit of its own bytes, beside
  what a load would decide (backends/torch/quant_speed.py: its projections timed through
  the kernel against dense; pays or not).

On the CPU (`--cpu`) the same code runs on the tiny shapes in float32 with traced graphs
(the CPU twin of CUDA graphs: the same captures, replays and refusals), where both paths are
forced (the CPU picks neither: its kernel takes masks and GQA as they are) and no load-time
verdict is timed (check_quant_speed times CUDA kernels only). Nothing here is imported by
the product.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ssdlocal.backends.torch import attention

K = 4
SPANS = (1024, 8192, 32768)  # slots one step attends: the K/V it reads grows with them
PATHS = ("efficient-folded", "batched-matmul")  # the two ways a masked CUDA step may run
ATOL = 1e-5  # float32 agreement of the two paths (tests/test_attention.py holds the same)
REPEATS = 20


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def forced_path(kernel: str) -> Iterator[None]:
    """Every masked step built inside takes `kernel` (an unmasked prefill keeps its own)."""
    real = attention.attention_kernel

    def chosen(device_type: str, masked: bool, rows: int = 1, span: int = 0) -> str:
        return kernel if masked else real(device_type, masked, rows, span)

    attention.attention_kernel = chosen
    try:
        yield
    finally:
        attention.attention_kernel = real


def kv_bytes(args, span: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one step reads over `span` slots of one row, every layer."""
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * span * torch.empty((), dtype=dtype).element_size()


def read_bytes(model) -> int:
    """Bytes of weights one step reads: every parameter and quantized linear's codes and
    scales once (no KV cache); the token embedding only where it is the lm_head (a lookup
    reads rows)."""
    from ssdlocal.backends.torch.quant import QuantLinear

    embed = model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    shared = head is not None and head.data_ptr() == embed.data_ptr()
    quantized = [b for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers(recurse=False)]
    seen, total = set() if shared else {embed.data_ptr()}, 0
    for t in [*model.parameters(), *quantized]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _spanned_runner(loaded, graphs: str, span: int):
    """A runner whose one row holds span - K - 1 tokens of random K/V (nothing is prefilled):
    its T=1 and T=K+1 steps, bounded by `span`, attend exactly `span` slots."""
    from ssdlocal.backends.torch.runner import TorchRunner

    runner = TorchRunner(loaded, graphs=graphs)
    held = span - K - 1
    runner.reset(1, span)
    runner.held[0] = [1] * held
    runner.begin_steps()
    runner.step(torch.ones(1, K + 1, dtype=torch.long, device=runner.device), span)  # the cache grows to span
    if runner.graphs is not None:
        runner.graphs.clear()
    gen = torch.Generator(device=runner.device).manual_seed(0)
    with torch.inference_mode():  # the cache is an inference tensor
        for layer in loaded.model.layers:
            for t in layer.self_attn.kv_cache.tensors():
                t.normal_(0.0, 1.0, generator=gen)
    return runner, held


def _step_ms(runner, width: int, bound: int) -> tuple[float, torch.Tensor]:
    """Median ms of a `width`-token step bounded by `bound` (its span), and its last logits."""
    from gpu_bench import timed

    ids = torch.ones(1, width, dtype=torch.long, device=runner.device)
    ms = timed(lambda: runner.step(ids, bound), runner.device, REPEATS)
    return ms, runner.step(ids, bound)[0, -1].float().clone()  # [V] logits of the last position


def paths_agree(args, span: int, device: torch.device) -> float:
    """Max |difference| of the two paths' outputs over `span` slots in float32 (a verify's
    K+1 queries of one row, a causal mask with the row's earlier slots visible)."""
    from ssdlocal.backends.torch.attention import AttentionMask, attend

    gen = torch.Generator(device=device).manual_seed(0)
    groups = args.num_heads // args.num_kv_heads
    q = torch.randn(1, args.num_heads, K + 1, args.head_dim, generator=gen, device=device)
    keys = torch.randn(1, args.num_kv_heads, span, args.head_dim, generator=gen, device=device)
    values = torch.randn(1, args.num_kv_heads, span, args.head_dim, generator=gen, device=device)
    positions = span - K - 1 + torch.arange(K + 1, device=device)  # [T]
    mask = (torch.arange(span, device=device)[None] <= positions[:, None])[None]  # [1, T, S]
    outs = []
    for kernel in PATHS:
        with forced_path(kernel):
            built = AttentionMask.build(mask, groups, torch.float32)
        assert built.kernel == kernel
        outs.append(attend(q, keys, values, keys, values, built))  # [1, H, T, D]
    return float((outs[0] - outs[1]).abs().max())


def attention_spans(name: str, device: torch.device, bandwidth: float, results, step: str = "attention_spans") -> None:
    """Both masked-step paths at each of SPANS (see the module docstring)."""
    from gpu_bench import random_model

    cuda = device.type == "cuda"
    dtype, graphs = (torch.bfloat16, "auto") if cuda else (torch.float32, "trace")
    loaded = random_model(name, device, dtype)
    args, weights = loaded.args, read_bytes(loaded.model)
    groups = args.num_heads // args.num_kv_heads
    rows = []
    for span in SPANS:
        runner, held = _spanned_runner(loaded, graphs, span)
        limit_ms = (weights + kv_bytes(args, span, dtype)) / bandwidth * 1e3
        diff = paths_agree(args, span, device)
        if diff > ATOL:
            results.fail(f"{step}: the two paths differ by {diff:.2e} in float32 at {span} slots")
        picks = {w: attention.attention_kernel("cuda", True, groups * w, span) for w in (1, K + 1)}  # not forced
        logits = {}
        for kernel in PATHS:
            if runner.graphs is not None:
                runner.graphs.clear()  # one graph per shape: the other path's goes
            with forced_path(kernel):
                for width in (1, K + 1):
                    ms, logits[(kernel, width)] = _step_ms(runner, width, span)
                    rows.append(
                        {
                            "model": name,
                            "span": span,
                            "T": width,
                            "path": kernel,
                            "cuda_picks": picks[width],
                            "ms": round(ms, 3),
                            "limit_ms": round(limit_ms, 3),
                            "over_limit": round(ms / limit_ms, 2),
                            "kv_share": round(kv_bytes(args, span, dtype) / (weights + kv_bytes(args, span, dtype)), 2),
                            "f32_paths_max_diff": f"{diff:.1e}",
                        }
                    )
        for width in (1, K + 1):
            gap = (logits[(PATHS[0], width)] - logits[(PATHS[1], width)]).abs().max()
            for row in rows[-2 * len(PATHS) :]:
                if row["T"] == width:
                    row[f"{_name(dtype)}_logits_max_diff"] = f"{float(gap):.1e}"
        if runner.graphs is not None:
            stats = runner.graphs.stats
            if stats.refused or stats.dropped or not stats.replays:
                results.fail(f"{step}: graphs at {span} slots refused, dropped or never replayed: {stats.as_dict()}")
        results.put(step, {"model": name, "dtype": _name(dtype), "graphs": graphs, "rows": rows})
        print(f"  {span} slots: {[(r['path'], r['T'], r['ms']) for r in rows[-4:]]}", flush=True)
        del runner
        torch.cuda.empty_cache() if cuda else None


def quant_speed(
    names: tuple[str, ...], device: torch.device, bandwidth: float, results, step: str = "quant_speed"
) -> None:
    """Steps with dense, int8 and int4 weights (see the module docstring)."""
    from gpu_bench import prefilled, random_model, step_ms

    from ssdlocal.backends.torch import quant_speed as load_check
    from ssdlocal.backends.torch.quant_apply import quantize_model

    cuda = device.type == "cuda"
    dtype, graphs, prompt = (torch.bfloat16, "auto", 512) if cuda else (torch.float32, "trace", 128)
    rows = []
    for name in names:
        dense_ms: dict[int, float] = {}
        for scheme in ("none", "int8", "int4"):
            loaded = random_model(name, device, dtype)
            quantize_model(loaded.model, scheme)  # on the model's device
            weights = read_bytes(loaded.model)
            limit_ms = (weights + kv_bytes(loaded.args, prompt, dtype)) / bandwidth * 1e3
            runner = prefilled(loaded, graphs, prompt)
            row = {"model": name, "weights": "dense" if scheme == "none" else scheme, "dtype": _name(dtype)}
            row["weight_gb"] = float(f"{weights / 1e9:.3g}")
            row["limit_ms"] = round(limit_ms, 3)
            for width in (1, K + 1):
                ms = step_ms(runner, width, REPEATS)
                dense_ms.setdefault(width, ms)
                row[f"T{width}_ms"] = round(ms, 3)
                row[f"T{width}_over_limit"] = round(ms / limit_ms, 2)
                row[f"T{width}_vs_dense"] = round(ms / dense_ms[width], 2)
            if scheme != "none":
                if cuda:
                    speed = load_check.measured_speed(loaded.args, scheme, device, dtype)
                    row["load_verdict"] = (
                        "pays: " if speed.pays else "refused unless memory needs it: "
                    ) + speed.describe()
                else:
                    row["load_verdict"] = "not timed on the CPU (check_quant_speed times CUDA kernels)"
            if runner.graphs is not None:
                stats = runner.graphs.stats
                if stats.refused or stats.dropped or not stats.replays:
                    results.fail(
                        f"{step}: {name} {scheme} graphs refused, dropped or never replayed: {stats.as_dict()}"
                    )
            rows.append(row)
            results.put(step, {"graphs": graphs, "prompt_tokens": prompt, "rows": rows})
            print(f"  {row}", flush=True)
            del runner, loaded
            torch.cuda.empty_cache() if cuda else None
