"""GPU benchmark of the engine's building blocks on random weights in real model shapes.

    python scripts/gpu_bench.py                 # one CUDA GPU, no network, < 8 minutes on an H200
    python scripts/gpu_bench.py --cpu --quick   # the same code on the CPU with tiny shapes

Models are Qwen2.5 shapes (1.5B, 7B and 32B targets; the 0.5B draft) built in memory with
random bf16 weights (timings do not depend on the values). For each model: one forward at
T=1 and T=K+1 tokens (eager kernels vs CUDA graphs) beside its memory-bandwidth limit
(weight bytes read / measured device copy bandwidth), the draft's tree step at several
branch widths, AR tokens/s of a decode loop, and the cost of one SD round (K draft steps,
one K+1-token verify, on-device verification, one host read-back). The 1.5B + 0.5B pair
is also written to disk and run end to end through the Engine in AR, SD and SSD (the SSD
draft in a second process on the same GPU); random models agree on almost nothing, so
SSD there mostly misses: its row shows the overlap machinery, not its speedup. Projected
SD/SSD speedups combine the measured GPU costs with acceptance and hit rates measured on
the CPU for the real pair (--rates, default scripts/cpu_pair_rates.json), and are
labelled as projections. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ssdlocal.backends.torch.loader import LoadedModel  # noqa: E402
from ssdlocal.backends.torch.models.llama import Llama, LlamaArgs  # noqa: E402
from ssdlocal.backends.torch.runner import TorchRunner  # noqa: E402
from ssdlocal.core.config import SamplingParams  # noqa: E402
from ssdlocal.core.verify import verify_logits  # noqa: E402
from ssdlocal.draft.base import RoundOutcome  # noqa: E402
from ssdlocal.draft.decode import Drafting  # noqa: E402
from ssdlocal.draft.sync import ModelDrafter  # noqa: E402

K = 4
WIDTHS = (1, 2, 4, 8, 16, 32)
PROMPT = 512
SHAPES = {  # name: (hidden, layers, heads, kv heads, intermediate, vocab, tied)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-32b": (5120, 64, 40, 8, 27648, 152064, False),
    "tiny-draft": (64, 2, 4, 2, 128, 512, True),
    "tiny-target": (128, 4, 4, 2, 256, 512, False),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def model_args(name: str) -> LlamaArgs:
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[name]
    return LlamaArgs(
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        qkv_bias=True,
        qk_norm=False,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
    )


def random_model(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A Qwen2-shaped model of `name`'s size with random weights, built directly on `device`."""
    return random_weights(Llama, model_args(name), Path(name), device, dtype)


def random_weights(build, args, path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """`build(args)` with random weights built on `device` (norms 1, the rest N(0, 0.02); a
    tied head shares the embedding), as a LoadedModel named `path`."""
    with torch.device("meta"):
        model = build(args).to(dtype)
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.requires_grad_(False).eval()
    return LoadedModel(model, None, args, None, path, device, dtype, ())


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes one forward reads: every weight once (an untied embedding only by rows)."""
    seen, total = set(), 0
    for pname, p in loaded.model.named_parameters():
        if p.data_ptr() in seen or (pname == "embed_tokens.weight" and not loaded.args.tie_word_embeddings):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    """Median milliseconds of fn() (device work included), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_bandwidth(device: torch.device, gb: float) -> float:
    """Device copy bandwidth in bytes/s, counting read + write (2 x size per copy)."""
    src = torch.empty(int(gb * 1e9) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def prefilled(loaded: LoadedModel, graphs: str, prompt: int) -> TorchRunner:
    runner = TorchRunner(loaded, graphs=graphs)
    runner.reset(1, prompt + 256)
    runner.feed([list(range(1, prompt + 1))], "none")
    runner.begin_steps()
    return runner


def step_ms(runner: TorchRunner, width: int, repeats: int) -> float:
    ids = torch.ones(1, width, dtype=torch.long, device=runner.device)
    return timed(lambda: runner.step(ids), runner.device, repeats)


def tree_ms(runner: TorchRunner, width: int, repeats: int) -> float:
    """One tree step of `width` branches over the prompt (each branch sees the prompt + itself)."""
    dev, S, L = runner.device, runner.capacity, runner.cached(0)
    ids = torch.ones(1, width, dtype=torch.long, device=dev)
    slots = (L + torch.arange(width, device=dev))[None]  # [1, W] one scratch slot per branch
    span = torch.arange(S, device=dev)
    mask = (span[None, None] < L) | (span[None, None] == slots[..., None])  # [1, W, S]
    return timed(lambda: runner.forward_raw(ids, slots, slots, mask), dev, repeats)


def ar_tokens_per_s(runner: TorchRunner, tokens: int) -> float:
    """Decode loop on the device: step, argmax, advance; one host sync at the end."""
    token = torch.ones(1, 1, dtype=torch.long, device=runner.device)
    sync(runner.device)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = runner.step(token)[:, -1:].argmax(-1)
        runner.advance(1)
    sync(runner.device)
    return tokens / (time.perf_counter() - t0)


def measure_model(name, device, dtype, graph_mode, bandwidth, repeats, prompt) -> dict:
    loaded = random_model(name, device, dtype)
    row = {"model": name, "weight_gb": weight_bytes(loaded) / 1e9}
    row["bandwidth_limit_ms"] = weight_bytes(loaded) / bandwidth * 1e3
    for label, mode in (("eager", "off"), ("graphs", graph_mode)):
        runner = prefilled(loaded, mode, prompt)
        row[f"T1_{label}_ms"] = step_ms(runner, 1, repeats)
        row[f"T{K + 1}_{label}_ms"] = step_ms(runner, K + 1, repeats)
        if name.endswith("0.5b") or name == "tiny-draft":
            for w in WIDTHS:
                row[f"tree{w}_{label}_ms"] = tree_ms(runner, w, repeats)
        if label == "graphs":
            row["ar_tok_s"] = ar_tokens_per_s(prefilled(loaded, mode, prompt), 64 if repeats < 10 else 128)
        del runner
    log("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return row


def sd_round_ms(target: LoadedModel, draft: LoadedModel, graph_mode: str, rounds: int, prompt: int) -> float:
    """One SD round as the engine runs it, minus host bookkeeping: K draft steps, the K+1
    verify, verify_logits on the device, and the one device -> host read of the verdict."""
    params = SamplingParams(max_new_tokens=rounds * (K + 1) + 8)
    t_runner = prefilled(target, graph_mode, prompt)
    d_runner = TorchRunner(draft, graphs=graph_mode)
    drafter = ModelDrafter(Drafting(d_runner, K, params, target.args.vocab_size), target.device)
    row = SimpleNamespace(tokens=list(range(1, prompt + 2)))  # what a drafter reads of a row
    row.length = len(row.tokens)
    row.tail = lambda start: row.tokens[start:]
    drafter.reserve(1, prompt + rounds * (K + 1) + 64)  # the target's runner has 256 spare
    drafter.start([row])
    last = torch.tensor([row.tokens[-1]], device=target.device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        proposal = drafter.propose([True])
        logits = t_runner.step(torch.cat([last[:, None], proposal.drafts], 1), row.length + K)
        verdict = verify_logits(logits, proposal.drafts, None, params, None, proposal.n_draft)
        host = torch.cat([verdict.n_accepted, verdict.bonus, proposal.drafts[0]]).tolist()
        n, bonus, drafts = host[0], host[1], host[2:]
        t_runner.advance(1 + verdict.n_accepted)
        row.tokens += drafts[:n] + [bonus]
        row.length = len(row.tokens)
        drafter.observe(RoundOutcome((tuple(drafts[:n] + [bonus]),), (n,), (bonus,), (True,), verdict))
        last = verdict.bonus
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (use with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (checks the script)")
    ap.add_argument(
        "--rates",
        default=str(ROOT / "scripts" / "cpu_pair_rates.json"),
        help="acceptance / hit rates measured on the CPU for the real pair",
    )
    ap.add_argument("--out", default="gpu-bench-out")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        log("no CUDA device (use --cpu --quick to check the script)")
        return 2
    device = torch.device("cpu" if args.cpu else "cuda:0")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    graph_mode = "trace" if args.cpu else "auto"
    repeats = 3 if args.quick else 20
    prompt = 32 if args.quick else PROMPT
    names = (
        ("tiny-draft", "tiny-target") if args.quick else ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b")
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "k": K,
        "dtype": str(dtype),
        "quick": args.quick,
    }
    bandwidth = copy_bandwidth(device, 0.05 if args.quick else 2.0)
    results["copy_bandwidth_gb_s"] = bandwidth / 1e9
    log(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    results["models"] = [measure_model(n, device, dtype, graph_mode, bandwidth, repeats, prompt) for n in names]
    draft = random_model(names[0], device, dtype)
    results["sd_rounds"] = {}
    for name in names[1:]:
        target = random_model(name, device, dtype)
        results["sd_rounds"][name] = sd_round_ms(target, draft, graph_mode, 6 if args.quick else 20, prompt)
        log(f"  SD round {name} + {names[0]}: {results['sd_rounds'][name]:.2f} ms")
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from gpu_bench_report import end_to_end, projections, write_markdown

    results["end_to_end"] = end_to_end(names[:2], device, dtype, args.quick, random_model)
    results["projections"] = projections(results, Path(args.rates), K)
    results["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out / "results.md")
    log((out / "results.md").read_text())
    log(f"done in {results['wall_s']:.0f} s; {out}/results.json, {out}/results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
