"""The speculative-round steps of scripts/gpu_accept.py in timing shapes: whole SD rounds
through the engine with a Qwen3.5 hybrid target, and with an EAGLE-3 head beside a
Llama-3.1-8B-shaped target, checkpoints of random bf16 weights written from the device.

- `hybrid_rounds`: the Qwen3.5-9B-shaped hybrid of accept_hybrid.py (8 of 32 layers) as a
  checkpoint, SD with a small random draft model of its vocabulary (a 2-layer llama of
  width 256): it proposes K tokens every round and the target rejects nearly all of them,
  so every round verifies K+1 tokens and rolls its linear states back on the device.
- `head_rounds`: a Llama-3.1-8B-shaped target (hidden 4096, 32 query / 8 key-value heads
  of 128, MLP 14,336, vocabulary 128,256, untied head; 8 of its 32 layers) and an EAGLE-3
  head shaped like the published Llama-3.1-8B head (one decoder layer of 32 / 8 heads,
  MLP 14,336, the fused hidden states of layers 2, 4 and 5 of the 8, a 32,000-token draft
  vocabulary mapped into the 128,256).
Per model, rows of: host waits per round in SD with graphs (a 40-token greedy call minus a
1-token one, over the rounds between them: torch.cuda.set_sync_debug_mode's count on a GPU,
the engine's own audit (core/hostsync.py) beside it and alone on the CPU) against
accept_steps.HOST_WAIT_BUDGET["sd"]; draft and verify ms per round (bf16); graph counts
(none refused or dropped, some replayed); and exactness in float32 on the same checkpoint
(bf16 rounds a verify's wider matmuls differently from a decode step's): SD with graphs
equals AR with graphs and AR of an eager engine, token for token. The prompts use the tiny
suite's tokenizer; ids past its vocabulary are generated and compared as ids (their text is not read).
Weights are random, so acceptance means nothing; costs and exactness do not depend on it.
`--cpu` runs the same code on tiny shapes with traced graphs. Nothing here is imported by
the product.
"""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from pathlib import Path

import torch
from accept_hybrid import qwen3_5_fields
from accept_steps import HOST_WAIT_BUDGET

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import HeadDraft, ModelDraft
from ssdlocal.engine import Engine

K = 4
PROMPTS = ["hello world, def foo(x):"]
TOKENS = 40


def llama_fields(smoke: bool, vocab: int) -> dict:
    """transformers' LlamaConfig fields: a Llama-3.1-8B layer, 8 of its 32 layers (tiny
    ones with `smoke`, `vocab` the tiny tokenizer's size)."""
    if smoke:
        sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        layers, theta = 4, 10_000.0
    else:
        sizes = dict(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128
        )
        layers, theta = 8, 500_000.0
    return dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab if smoke else 128256,
        num_hidden_layers=layers,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        **sizes,
    )


def small_draft(root: Path, tokenizer_dir: Path, vocab: int, device: torch.device, smoke: bool) -> Path:
    """A random 2-layer llama of width 256 over `vocab` ids (width 32 with `smoke`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = llama_fields(True, vocab)
    width = 32 if smoke else 256
    fields.update(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, head_dim=width // 4)
    return write_checkpoint(root / "draft", LlamaConfig(**fields), LlamaForCausalLM, tokenizer_dir, device)


def write_checkpoint(out: Path, config, model_cls, tokenizer_dir: Path, device: torch.device) -> Path:
    """A safetensors checkpoint of `model_cls(config)`'s tensor names and shapes with random
    bf16 values drawn on `device` (norms 1, the rest N(0, 0.02)), the tokenizer beside it."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        names = {n: p.shape for n, p in model_cls(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in names.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.fill_(1.0) if len(shape) == 1 and "norm" in name else t.normal_(0.0, 0.02, generator=gen)
        state[name] = t.cpu()
        del t
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def vocab_of(tokenizer_dir: Path) -> int:
    return len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])


def hybrid_checkpoint(root: Path, tokenizer_dir: Path, device: torch.device, smoke: bool) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**qwen3_5_fields(smoke, vocab_of(tokenizer_dir)))
    return write_checkpoint(root / "hybrid", config, Qwen3_5ForCausalLM, tokenizer_dir, device)


def head_checkpoints(root: Path, tokenizer_dir: Path, device: torch.device, smoke: bool) -> tuple[Path, Path]:
    """(the Llama-3.1-8B-shaped target, its EAGLE-3 head)."""
    from support.tiny_heads import make_eagle3
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**llama_fields(smoke, vocab_of(tokenizer_dir)))
    target = write_checkpoint(root / "llama", config, LlamaForCausalLM, tokenizer_dir, device)
    layers = config.num_hidden_layers
    if smoke:
        head = make_eagle3(root / "eagle3", target, draft_vocab=200, aux=(1, 2, 3), heads=4, kv=2)
    else:  # a low, a middle and a high layer, as published heads fuse them
        head = make_eagle3(
            root / "eagle3", target, draft_vocab=32000, aux=(2, layers // 2, layers - 3), heads=32, kv=8, inter=14336
        )
    return target, head


def _engine(path: Path, draft, device: str, graphs: str, dtype: str) -> Engine:
    spec = SpecConfig(mode=Mode.SD, k=K, draft=draft)
    return Engine(
        EngineConfig(target=ModelSpec(str(path), device, dtype=dtype), spec=spec, pin_cpus=False, graphs=graphs)
    )


def _free(device: str) -> None:
    """Give a closed engine's device memory back before the next loads (timing shapes)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _call(engine: Engine, mode: str, draft, tokens: int, count: bool):
    """(token ids, stats, torch's synchronisations or None) of one greedy call."""
    spec = SpecConfig(mode=Mode(mode), k=K, draft=draft)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    syncs = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if count:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            done = [e for e in engine.generate(PROMPTS, params, spec=spec) if isinstance(e, DoneEvent)][0]
        finally:
            if count:
                torch.cuda.set_sync_debug_mode("default")
    if count:
        syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    return [o.token_ids for o in done.outputs], done.stats, syncs


def _audit(stats: dict) -> int:
    return sum(w.get("waits", 0) for w in (stats.get("host_waits") or {}).values())


def _graphs(stats: dict) -> dict[str, int]:
    counts = {"captured": 0, "replays": 0, "refused": 0, "dropped": 0}
    for model in (stats.get("graphs") or {}).values():
        for key in counts:
            counts[key] += model.get(key, 0)
    return counts


def sd_rounds(name: str, path: Path, drafts, device: str, graph_mode: str, results, step: str, rows: list) -> None:
    """One row for `name`: host waits and ms per round (bf16, graphs), exactness in float32;
    `drafts(dtype)` the draft to use at that dtype."""
    cuda = device.startswith("cuda")
    budget = HOST_WAIT_BUDGET["sd"]
    row: dict = {"model": name}
    draft = drafts("bfloat16")
    with _engine(path, draft, device, graph_mode, "bfloat16") as engine:
        _, warm, _ = _call(engine, "sd", draft, TOKENS, False)  # captures, allocations
        _, long, syncs_long = _call(engine, "sd", draft, TOKENS, cuda)
        _, short, syncs_short = _call(engine, "sd", draft, 1, cuda)
    _free(device)
    rounds = max(1, long["rounds"] - short["rounds"])
    audit = (_audit(long) - _audit(short)) / rounds
    waits = (syncs_long - syncs_short) / rounds if cuda else audit
    row.update(
        rounds=rounds,
        waits_per_round=round(waits, 2),
        audit_waits_per_round=round(audit, 2),
        budget=budget,
        draft_ms_per_round=round(long["draft_ms"] / max(long["rounds"], 1), 3),
        verify_ms_per_round=round(long["verify_ms"] / max(long["rounds"], 1), 3),
        tokens_per_round=round(long.get("mean_accepted_len") or 0.0, 2),
        acceptance=round(long.get("acceptance_rate") or 0.0, 3),
        bf16_captured=_graphs(warm)["captured"] + _graphs(long)["captured"],
        **{f"bf16_{k}": v for k, v in _graphs(long).items() if k != "captured"},
    )
    draft = drafts("float32")
    with _engine(path, draft, device, graph_mode, "float32") as engine:
        sd, sd_stats, _ = _call(engine, "sd", draft, TOKENS, False)
        ar, _, _ = _call(engine, "ar", draft, TOKENS, False)
    _free(device)
    with _engine(path, draft, device, "off", "float32") as engine:
        eager, _, _ = _call(engine, "ar", draft, TOKENS, False)
    _free(device)
    counts = _graphs(sd_stats)
    row.update(sd_equals_ar=sd == ar, ar_graphs_equal_eager=ar == eager, **{f"f32_{k}": v for k, v in counts.items()})
    rows.append(row)
    results.put(step, {"graphs": graph_mode, "k": K, "tokens": TOKENS, "rows": rows})
    print(f"  {row}", flush=True)
    if waits > budget:
        results.fail(f"{step}: {name} waits on the host {waits:.2f} times per SD round (budget {budget})")
    if not (row["sd_equals_ar"] and row["ar_graphs_equal_eager"]):
        results.fail(f"{step}: {name}: SD with graphs, AR with graphs and eager AR differ (float32)")
    for label, c in (("bf16", _graphs(long)), ("float32", counts)):
        if c["replays"] == 0 or c["refused"] or c["dropped"]:
            results.fail(f"{step}: {name} {label} graphs not captured and replayed cleanly: {c}")


def hybrid_rounds(tokenizer_dir: Path, root: Path, device: torch.device, graph_mode: str, results) -> None:
    smoke = device.type == "cpu"
    path = hybrid_checkpoint(root, tokenizer_dir, device, smoke)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    small = small_draft(root, tokenizer_dir, vocab, device, smoke)
    name = "tiny qwen3.5 + draft model" if smoke else "qwen3.5-9b x8 + 2-layer draft"

    def drafts(dtype: str) -> ModelDraft:
        return ModelDraft(ModelSpec(str(small), str(device), dtype=dtype), suffix=None)

    sd_rounds(name, path, drafts, str(device), graph_mode, results, "hybrid_rounds", [])
    shutil.rmtree(path)
    shutil.rmtree(small)


def head_rounds(tokenizer_dir: Path, root: Path, device: torch.device, graph_mode: str, results) -> None:
    smoke = device.type == "cpu"
    target, head = head_checkpoints(root, tokenizer_dir, device, smoke)
    name = "tiny llama + eagle3 head" if smoke else "llama-3.1-8b x8 + eagle3 head"
    sd_rounds(name, target, lambda _dtype: HeadDraft(str(head)), str(device), graph_mode, results, "head_rounds", [])
    shutil.rmtree(target)
    shutil.rmtree(head)
