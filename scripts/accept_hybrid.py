"""The hybrid step of scripts/gpu_accept.py: decode (T=1) and verify (T=K+1) steps of a
Qwen3.5 hybrid model in timing shapes, random bf16 weights built on the device, eager and
in captured graphs, against the bandwidth limit of the bytes each step reads and writes.

- `qwen3.5-9b x8`: Qwen3.5-9B's layer as our Qwen3_5Args reads it from its config fields
  (hidden 4096, MLP 12,288; Gated DeltaNet layers of 16 key and 32 value heads of 128,
  convolution kernel 4; gated full attention of 16 query / 4 key-value heads of 256, a
  quarter of each rotated; vocabulary 248,320, untied head), 8 of its 32 layers: two
  periods of its pattern (three linear-attention layers, then one full-attention layer).
  Every period reads the same bytes, so the whole model's step is the layers' share times
  4 plus the head's.

Bytes a step reads and writes: every weight but the embedding table (its rows only); the
KV cache of the full-attention layers over the span the step attends to; of each linear
layer, the state after the token before the step (recurrent state in float32, the
convolution's last K-1 inputs) read once, and the state after every position the step
feeds written (hybrid_runner.py keeps them so that accepting j of the tokens restores the
state after token j on the device). `kept_mb` is what a step of T tokens writes so (T
states per row) and `kept_ms` the time of those writes alone (LinearStates.write, every
linear layer, as the step makes them). Exactness: the captured step's logits equal the
eager step's on the same prompt (bit for bit is reported; a different argmax is a
failure). `--cpu` runs the same code on tiny shapes with traced graphs. Nothing here is
imported by the product.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ssdlocal.backends.torch.hybrid_runner import HybridRunner
from ssdlocal.backends.torch.linear_states import LinearStates
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.models import args_from_config, build

K = 4
STEP = "hybrid_step_times"


def qwen3_5_fields(smoke: bool, vocab: int | None = None) -> dict:
    """transformers' Qwen3_5TextConfig fields: a Qwen3.5-9B layer, 8 of its 32 layers (two
    periods of three linear-attention layers and one full-attention layer); tiny ones with
    `smoke` (`vocab`: the tiny tokenizer's size)."""
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    if smoke:
        sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
        layers, theta = pattern, 10_000.0
    else:
        sizes = dict(
            hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256
        )
        linear = dict(
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128
        )
        layers, theta = pattern * 2, 10_000_000.0
    return dict(
        architectures=["Qwen3_5ForCausalLM"],
        vocab_size=vocab if smoke and vocab else (512 if smoke else 248320),
        num_hidden_layers=len(layers),
        layer_types=layers,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        **sizes,
        **linear,
    )


def hybrid_args(smoke: bool):
    """Our Qwen3_5Args of those fields, read as a checkpoint's config is read."""
    from transformers import Qwen3_5TextConfig

    return args_from_config(Qwen3_5TextConfig(**qwen3_5_fields(smoke)))


def prefilled(loaded: LoadedModel, graphs: str, prompt: int) -> HybridRunner:
    runner = HybridRunner(loaded, graphs=graphs)
    runner.reset(1, prompt + 256)
    runner.feed([list(range(1, prompt + 1))], "none")
    runner.begin_steps()
    return runner


def step(runner: HybridRunner, ids: torch.Tensor) -> torch.Tensor:
    """One step at the row's length; the length stays (a round that accepted nothing), so
    every repeat writes the same positions and the ring never has to grow."""
    out = runner.step(ids)
    runner.advance(0, [0])
    return out


def step_bytes(loaded: LoadedModel, span: int, width: int) -> tuple[int, int, int]:
    """(weight bytes, KV bytes, state bytes) one step of `width` tokens reads and writes:
    weights but the embedding table, the full-attention layers' KV over `span` slots, each
    linear layer's state before the step read and `width` states after it written."""
    model = loaded.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    size = torch.empty(0, dtype=loaded.dtype).element_size()
    kv = sum(2 * layer.self_attn.n_kv_heads * layer.self_attn.head_dim for layer in attention_layers(model)) * span
    return weights, kv * size, state_read(model, loaded.dtype) + width * state_written(model, loaded.dtype)


def attention_layers(model) -> list:
    return [layer for layer in model.layers if hasattr(layer, "self_attn")]


def state_read(model, dtype: torch.dtype) -> int:
    """One row's state before a step, every linear layer: recurrent (float32) and K-1 inputs."""
    return LinearStates.state_bytes(model.linear_shapes(), model.kernel, dtype)


def state_written(model, dtype: torch.dtype) -> int:
    """What a step writes per position and row: the recurrent state and one convolution input."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(h * dk * dv * 4 + c * size for c, h, dk, dv in model.linear_shapes())


def kept_ms(runner: HybridRunner, width: int, device: torch.device, repeats: int) -> float:
    """Median ms of writing `width` positions' states in every linear layer (LinearStates.write,
    the writes a step of `width` tokens makes to keep them), at the row's next positions."""
    from gpu_bench import timed

    states, start = runner.states, len(runner.held[0])
    positions = (start + torch.arange(width, device=device))[None]  # [1, W]
    made = []
    for layer, (c, h, dk, dv) in enumerate(states.shapes):
        inputs = torch.randn(1, width, c, device=device).to(states.dtype)  # [1, W, C]
        rec = torch.randn(1, width, h, dk, dv, device=device)  # [1, W, H, Dk, Dv] float32
        before = torch.randn(1, states.kernel - 1, c, device=device).to(states.dtype)  # [1, K-1, C]
        made.append((layer, inputs, rec, before))

    def write() -> None:
        for layer, inputs, rec, before in made:
            states.write(layer, positions, inputs, rec, before)

    return timed(write, device, repeats)


def hybrid_step_times(device: torch.device, bandwidth: float, graph_mode: str, results, smoke: bool) -> None:
    """One row per width: bytes read and written, the limit, eager and graph ms, the states
    a verify keeps and their time, exactness of the captured step against eager."""
    from accept_families import with_graphs
    from gpu_bench import random_weights, timed

    args = hybrid_args(smoke)
    name = "tiny qwen3.5" if smoke else "qwen3.5-9b x8"
    prompt, repeats = (32 if smoke else 512), (3 if smoke else 20)
    loaded = random_weights(build, args, Path(args.arch), device, torch.bfloat16)
    ids = {w: torch.randint(1, args.vocab_size, (1, w), generator=torch.Generator().manual_seed(w)) for w in (1, K + 1)}
    ids = {w: t.to(device) for w, t in ids.items()}  # [1, W] each: distinct tokens, as a verify scores
    measured: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}
    runners = {}
    for label, mode in (("eager", "off"), ("graphs", graph_mode)):  # one at a time: the model holds the states
        runner = prefilled(loaded, mode, prompt)
        for width in (1, K + 1):
            for _ in range(2):  # graphs: capture, then replay
                out = step(runner, ids[width]).clone()
            ms = timed(lambda r=runner, x=ids[width]: step(r, x), device, repeats)
            measured[(label, width)] = (out, ms)
        runners[label] = runner
    runner = runners["graphs"]
    stats = runner.graphs.stats if runner.graphs is not None else None
    rows = []
    for width in (1, K + 1):
        want, eager_ms = measured[("eager", width)]
        got, graphs_ms = measured[("graphs", width)]
        weights, kv, state = step_bytes(loaded, runner.capacity, width)
        limit = (weights + kv + state) / bandwidth * 1e3
        kept = width * state_written(loaded.model, loaded.dtype)
        row = {
            "model": name,
            "T": width,
            "weights_mb": round(weights / 1e6, 1),
            "kv_mb": round(kv / 1e6, 1),
            "states_mb": round(state / 1e6, 3),
            "limit_ms": round(limit, 3),
            "eager_ms": round(eager_ms, 3),
            "graphs_ms": round(graphs_ms, 3),
            "graphs_over_limit": round(graphs_ms / limit, 2),
            "kept_mb": round(kept / 1e6, 3),
            "kept_ms": round(kept_ms(runner, width, device, repeats), 3),
            "kept_limit_ms": round(kept / bandwidth * 1e3, 3),
            "bitwise": bool(torch.equal(got, want)),
            "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
        }
        rows.append(row)
        if not row["argmax_equal"]:
            results.fail(f"{STEP}: {name} T={width}: the captured step's tokens differ from eager")
        print(f"  {row}", flush=True)
    if stats is None or not stats.captured or not stats.replays or stats.refused or stats.dropped:
        results.fail(f"{STEP}: {name} graphs not captured and replayed cleanly: {stats}")
    rows = [with_graphs(row, stats) for row in rows]
    results.put(STEP, {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "graphs": graph_mode, "rows": rows})
    del runners, runner, loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
