"""The step of scripts/gpu_accept.py for the 2026 families: decode (T=1) and verify (T=K+1)
steps of a mixture-of-experts model and a sliding-window model in timing shapes, random
bf16 weights built on the device (timings do not depend on the values), eager and in
captured graphs, against the bandwidth limit of the bytes each step really reads.

- `qwen3-30b-a3b x12`: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value heads of
  128 with q/k norms, 128 experts of width 768, 8 per token, softmax routing renormalised)
  and its vocabulary (151,936, untied head), 12 of its 48 layers: every layer reads the
  same bytes, so the whole model's step is the layers' share times 4 plus the head's.
- `gemma3-12b-window x12`: a Gemma 3 12B-class dense model (hidden 3840, 16 query / 8
  key-value heads of 256, MLP 15,360, vocabulary 262,208, tied head) whose layers are the
  llama family's block with Gemma 3's pattern: five sliding-window layers (window 1,024)
  to one global, 12 of its 48 layers (two periods); the prompt (1,536 tokens) is longer
  than the window, so the local layers' masks drop slots. The llama block has two norms
  where Gemma has four and SiLU where it has GELU-tanh: the same matrices, so the same bytes.

Bytes a step reads: every weight but the untied embedding table (its rows only); of the
experts, only those the step's tokens chose (counted from the router in an eager step of
the same input: 8 of 128 per layer for one token, about 35 for five); the KV cache over
the span the step attends to (every slot up to the span in every layer, windowed or not:
the kernels read the masked slots too). Exactness: the captured step's logits equal the
eager step's on the same cache (bit for bit is reported; a different argmax is a failure).
`--cpu` runs the same code on tiny shapes with traced graphs. Nothing here is imported by
the product.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.models.layers import MLP
from ssdlocal.backends.torch.models.llama import Llama, LlamaArgs, LlamaBlock
from ssdlocal.backends.torch.models.moe import SoftmaxTopK
from ssdlocal.backends.torch.models.qwen3_moe import Qwen3Moe, Qwen3MoeArgs

K = 4
STEP = "family_step_times"


@dataclass(frozen=True)
class WindowedArgs(LlamaArgs):
    """The llama block with a sliding window in all layers but every `global_every`-th."""

    sliding_window: int = 0
    global_every: int = 6

    @property
    def window(self) -> int | None:
        return self.sliding_window


class Windowed(Llama):
    args: WindowedArgs

    def make_layer(self, index: int) -> torch.nn.Module:
        block = LlamaBlock(self.args, MLP(self.args.hidden_size, self.args.intermediate_size))
        if (index + 1) % self.args.global_every:
            block.self_attn.window = self.args.sliding_window
        return block


def _common(hidden, layers, heads, kv, head_dim, inter, vocab, tied, arch, qk_norm) -> dict:
    return dict(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        qkv_bias=False,
        qk_norm=qk_norm,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
    )


def moe_args(smoke: bool) -> Qwen3MoeArgs:
    if smoke:
        base = _common(64, 2, 4, 2, 16, 128, 512, False, "qwen3_moe", True)
        return Qwen3MoeArgs(**base, num_experts=8, experts_per_token=2, moe_intermediate_size=32, sparse_layers=(0, 1))
    base = _common(2048, 12, 32, 4, 128, 6144, 151936, False, "qwen3_moe", True)
    return Qwen3MoeArgs(
        **base, num_experts=128, experts_per_token=8, moe_intermediate_size=768, sparse_layers=tuple(range(12))
    )


def window_args(smoke: bool) -> WindowedArgs:
    if smoke:
        return WindowedArgs(**_common(64, 6, 4, 2, 16, 128, 512, True, "llama", False), sliding_window=16)
    return WindowedArgs(**_common(3840, 12, 16, 8, 256, 15360, 262208, True, "llama", False), sliding_window=1024)


def models(smoke: bool) -> list[tuple[str, type, object, int]]:
    """(name, model class, args, prompt tokens) of the step's two models."""
    return [
        ("qwen3-30b-a3b x12" if not smoke else "tiny moe", Qwen3Moe, moe_args(smoke), 32 if smoke else 512),
        ("gemma3-12b-window x12" if not smoke else "tiny window", Windowed, window_args(smoke), 48 if smoke else 1536),
    ]


def experts_read(runner, ids: torch.Tensor) -> list[int]:
    """Distinct experts each MoE layer's router picks in one eager step of `ids` [1, W]."""
    picked: list[int] = []

    def hook(_module, _inputs, output) -> None:
        picked.append(int(output[1].unique().numel()))  # output: (weights, experts [N, k])

    handles = [m.register_forward_hook(hook) for m in runner.model.modules() if isinstance(m, SoftmaxTopK)]
    try:
        runner.step(ids)
    finally:
        for h in handles:
            h.remove()
    return picked


def step_bytes(loaded: LoadedModel, experts_per_layer: list[int], span: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one step reads: weights as the module docstring says, the
    KV cache of `span` slots in every layer."""
    model, args = loaded.model, loaded.args
    seen, weights = set(), 0
    moe_layers = iter(experts_per_layer)
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            share = next(moe_layers) / module.num_experts
            weights += int(sum(p.numel() * p.element_size() for p in module.parameters()) * share)
            seen |= {p.data_ptr() for p in module.parameters()}
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or (name == "embed_tokens.weight" and not args.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        weights += p.numel() * p.element_size()
    kv = sum(2 * layer.self_attn.n_kv_heads * layer.self_attn.head_dim for layer in model.layers) * span
    return weights, kv * torch.empty(0, dtype=loaded.dtype).element_size()


def family_step_times(device: torch.device, bandwidth: float, graph_mode: str, results, smoke: bool) -> None:
    """One row per model and width: bytes read, the limit, eager and graph ms, exactness."""
    from gpu_bench import prefilled, random_weights, timed

    dtype = torch.bfloat16
    repeats = 3 if smoke else 20
    rows = []
    for name, cls, args, prompt in models(smoke):
        loaded = random_weights(cls, args, Path(args.arch), device, dtype)
        eager, graphs = prefilled(loaded, "off", prompt), prefilled(loaded, graph_mode, prompt)
        first = len(rows)
        for width in (1, K + 1):
            # distinct tokens, as a verification scores: they route to other experts
            gen = torch.Generator().manual_seed(width)
            ids = torch.randint(1, args.vocab_size, (1, width), generator=gen).to(device)  # [1, W]
            want = eager.step(ids).clone()
            for _ in range(2):  # capture, then replay
                got = graphs.step(ids).clone()
            span = graphs.capacity
            counted = experts_read(eager, ids)
            weights, kv = step_bytes(loaded, counted, span)
            limit = (weights + kv) / bandwidth * 1e3
            row = {
                "model": name,
                "T": width,
                "experts_read": f"{sum(counted) / len(counted):.1f}/{args.num_experts}" if counted else "dense",
                "weights_mb": round(weights / 1e6, 1),
                "kv_mb": round(kv / 1e6, 1),
                "limit_ms": round(limit, 3),
                "eager_ms": round(timed(lambda r=eager, x=ids: r.step(x), device, repeats), 3),
                "graphs_ms": round(timed(lambda r=graphs, x=ids: r.step(x), device, repeats), 3),
                "bitwise": bool(torch.equal(got, want)),
                "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
            }
            row["graphs_over_limit"] = round(row["graphs_ms"] / limit, 2)
            rows.append(row)
            if not row["argmax_equal"]:
                results.fail(f"{STEP}: {name} T={width}: the captured step's tokens differ from eager")
            results.put(STEP, {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "graphs": graph_mode, "rows": rows})
            print(f"  {row}", flush=True)
        stats = graphs.graphs.stats if graphs.graphs is not None else None
        if stats is None or not stats.captured or not stats.replays or stats.refused or stats.dropped:
            results.fail(f"{STEP}: {name} graphs not captured and replayed cleanly: {stats}")
        rows[first:] = [with_graphs(row, stats) for row in rows[first:]]
        results.put(STEP, {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "graphs": graph_mode, "rows": rows})
        del eager, graphs, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()


def with_graphs(row: dict, stats) -> dict:
    """`row` with the model's graph counts (captured / replays / refused / dropped)."""
    counts = stats.as_dict() if stats is not None else {}
    return {**row, **{k: counts.get(k) for k in ("captured", "replays", "refused", "dropped")}}
