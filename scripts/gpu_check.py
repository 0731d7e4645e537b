"""GPU checks and timings for the tensor-parallel target, SSD across GPUs and the q channel.

Run on a machine with CUDA (no network needed; tiny checkpoints are written to a temp
dir with tests/support/tiny_models.py):

    python scripts/gpu_check.py              # everything this machine allows
    python scripts/gpu_check.py --quick      # one architecture, fewer timing repeats
    python scripts/gpu_check.py --cpu        # the same checks on CPU ranks (gloo): checks the script
    python scripts/gpu_check.py --synthetic medium   # also time a ~0.3B random model (bf16)

Checks (exit code 1 if any exactness check fails):
  1. inventory and the planner's plan for this machine;
  2. TP=N target == TP=1 target, greedy fp32, llama / qwen2 / qwen3 (needs N >= 2 GPUs;
     N = largest power of two <= GPU count that divides the heads);
  3. SSD (and SD) == AR with the target on cuda:0 (or the TP group) and the draft in its
     own process on the next free GPU, or on cuda:0 when there is only one GPU;
  4. q channel: the automatic choice, and a CUDA IPC round trip (child process writes q
     from its GPU into the target's buffer) compared with the shared-memory path;
  5. CUDA graphs (the captured decode and tree steps) give the eager path's tokens;
  6. timings: per-forward latency of the target for 1 and K+1 tokens, TP=1 vs TP=N.
Results are printed and written to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402
from ssdlocal.core.events import DoneEvent  # noqa: E402
from support.drafts import draft_of  # noqa: E402
from ssdlocal.core.config import ModelDraft  # noqa: E402

PROMPTS = ["The quick brown fox", "hello world, def foo(x):"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
K = 4


def log(msg: str) -> None:
    print(msg, flush=True)


def tokens(engine: Engine, spec: SpecConfig | None = None, prompts=PROMPTS) -> list[tuple[int, ...]]:
    done = [e for e in engine.generate(prompts, GREEDY, spec=spec) if isinstance(e, DoneEvent)]
    return [o.token_ids for o in done[0].outputs]


def config(
    path, devices: tuple[str, ...], dtype="float32", mode=Mode.AR, draft=None, draft_device="cpu"
) -> EngineConfig:
    return EngineConfig(
        target=ModelSpec(str(path), devices[0], dtype),
        spec=SpecConfig(mode=mode, k=K, draft=draft_of(None if draft is None else str(draft), draft_device, dtype)),
        pin_cpus=False,
        target_devices=devices if len(devices) > 1 else (),
    )


def tp_degree(n_devices: int, heads: tuple[int, ...] = (4, 2)) -> int:
    d = 1
    while d * 2 <= n_devices and all(h % (d * 2) == 0 for h in heads):
        d *= 2
    return d


# --------------------------------------------------------------------------- checks


def check_inventory(results: dict) -> None:
    from ssdlocal.placement.inventory import detect
    from ssdlocal.placement.planner import plan_placement
    from ssdlocal.placement.devarg import plan_flags

    inv = detect()
    log(
        f"GPUs: {[(g.index, g.name, round(g.total_gb, 1)) for g in inv.gpus]}; "
        f"interconnect {inv.interconnect}; {inv.cpu_cores} cores"
    )
    entry = {"gpus": [g.name for g in inv.gpus], "interconnect": inv.interconnect}
    for label, t_gb, d_gb, heads in (
        ("7B+0.5B", 15.2, 1.0, (28, 4)),
        ("32B+1.5B", 65.5, 3.1, (40, 8)),
        ("70B+1B", 141.0, 2.5, (64, 8)),
    ):
        try:
            plan = plan_placement(inv, t_gb, d_gb, heads=heads)
            entry[label] = plan_flags(plan)
        except Exception as exc:  # noqa: BLE001 - a plan that does not fit is a result too
            entry[label] = f"no fit: {getattr(exc, 'message', exc)}"
        log(f"  plan {label}: {entry[label]}")
    results["inventory"] = entry


def check_tp_exact(dirs, devices, archs, results: dict) -> bool:
    ok = True
    for arch in archs:
        with Engine(config(dirs[arch], devices[:1])) as one:
            want = tokens(one)
        with Engine(config(dirs[arch], devices)) as many:
            got = tokens(many)
        same = got == want
        ok &= same
        results.setdefault("tp_exact", {})[arch] = same
        log(f"  TP={len(devices)} vs TP=1 {arch}: {'identical' if same else 'DIFFERENT'}")
    return ok


def check_ssd(dirs, target_devices, draft_device, results: dict) -> bool:
    cfg = config(dirs["llama"], target_devices, mode=Mode.SSD, draft=dirs["draft_llama"], draft_device=draft_device)
    with Engine(cfg) as eng:
        ar = tokens(eng, SpecConfig(mode=Mode.AR))
        ssd = tokens(eng, SpecConfig(mode=Mode.SSD, k=K, draft=cfg.spec.draft))
        sd = tokens(eng, SpecConfig(mode=Mode.SD, k=K, draft=cfg.spec.draft))
    ok = ssd == ar and sd == ar
    results["ssd_exact"] = {"target": list(target_devices), "draft": draft_device, "ssd": ssd == ar, "sd": sd == ar}
    log(
        f"  target {','.join(target_devices)} draft {draft_device}: SSD {'==' if ssd == ar else '!='} AR, "
        f"SD {'==' if sd == ar else '!='} AR"
    )
    return ok


def _ipc_child(conn, draft_device: str, vocab: int) -> None:
    from ssdlocal.ipc.qchannel import write_q

    buffer = conn.recv()  # CUDA tensor: arrives as an IPC handle
    torch.cuda.set_device(torch.device(draft_device))
    for _ in range(conn.recv()):
        seed = conn.recv()
        q = torch.softmax(
            torch.randn(1, K, vocab, device=draft_device, generator=torch.Generator(draft_device).manual_seed(seed)), -1
        )
        write_q(buffer, q)
        conn.send(seed)
    del buffer
    conn.send("bye")


def check_channel(target_device: str, draft_device: str, results: dict, repeats: int) -> bool:
    from ssdlocal.ipc.qchannel import QChannel, choose_q_channel, write_q

    choice = choose_q_channel(target_device, draft_device)
    log(f"  channel for {target_device} -> {draft_device}: {choice.kind} ({choice.reason})")
    entry = {"choice": choice.kind}
    vocab = 151_936
    shm = QChannel("shm", 1, K, vocab)
    q = torch.rand(1, K, vocab)
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        write_q(shm.buffer, q)
        shm.read()
        t.append(time.perf_counter() - t0)
    entry["shm_ms"] = 1e3 * statistics.median(t)
    ok = True
    if choice.kind == "cuda-ipc":
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_ipc_child, args=(child, draft_device, vocab), daemon=True)
        proc.start()
        channel = QChannel("cuda-ipc", 1, K, vocab, target_device)
        parent.send(channel.buffer)
        parent.send(repeats)
        t = []
        for seed in range(repeats):
            t0 = time.perf_counter()
            parent.send(seed)
            if not parent.poll(60):
                raise RuntimeError("CUDA IPC child did not answer")
            parent.recv()
            got = channel.read()
            t.append(time.perf_counter() - t0)
            want = torch.softmax(
                torch.randn(
                    1, K, vocab, device=draft_device, generator=torch.Generator(draft_device).manual_seed(seed)
                ),
                -1,
            )
            ok &= torch.equal(got, want.to(got.device))
        parent.recv()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        entry["cuda_ipc_roundtrip_ms"] = 1e3 * statistics.median(t)
        entry["cuda_ipc_correct"] = bool(ok)
        log(
            f"  cuda-ipc round trip {entry['cuda_ipc_roundtrip_ms']:.3f} ms (correct: {ok}); "
            f"shm write+read {entry['shm_ms']:.3f} ms"
        )
    else:
        log(f"  shm write+read {entry['shm_ms']:.3f} ms")
    results["channel"] = entry
    return ok


def forward_ms(engine: Engine, n_tokens: int, repeats: int) -> float:
    """Median latency of one target step of `n_tokens` new tokens after a 64-token prefix
    (steps do not move the write position, so each one rewrites the same slots)."""
    runner = engine.runner
    runner.reset(1, 256)
    runner.feed([list(range(5, 69))])
    runner.begin_steps()
    ids = torch.arange(7, 7 + n_tokens, device=runner.device)[None]  # [1, T]
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        runner.step(ids).sum().item()  # .item(): includes the device sync
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def check_graphs_exact(dirs, device: str, results: dict) -> bool:
    """CUDA graphs (or their CPU twin, traced graphs) give the eager kernels' tokens, AR / SD / SSD."""
    draft = str(dirs["draft_llama"])
    want = None
    for graphs in ("off", "trace" if device == "cpu" else "auto"):
        cfg = EngineConfig(
            target=ModelSpec(str(dirs["llama"]), device, "float32"),
            spec=SpecConfig(mode=Mode.SSD, k=K, draft=ModelDraft(ModelSpec(draft, device, "float32"))),
            pin_cpus=False,
            graphs=graphs,
        )
        with Engine(cfg) as eng:
            got = [tokens(eng, SpecConfig(mode=m, k=K, draft=cfg.spec.draft)) for m in (Mode.AR, Mode.SD, Mode.SSD)]
            stats = eng.runner.graphs.stats if eng.runner.graphs is not None else None
        want = want or got
    same = got == want and got[0] == got[1] == got[2]
    results["graphs_exact"] = {
        "identical": same,
        "captured": stats.captured if stats else 0,
        "replays": stats.replays if stats else 0,
    }
    log(
        f"  graphs vs eager on {device}: {'identical' if same else 'DIFFERENT'} "
        f"({results['graphs_exact']['captured']} shapes captured, {results['graphs_exact']['replays']} replays)"
    )
    return same


def check_timings(path, devices, dtype, label, results: dict, repeats: int) -> None:
    row = {}
    for group in ([devices[0]], list(devices)) if len(devices) > 1 else ([devices[0]],):
        with Engine(config(path, tuple(group), dtype=dtype)) as eng:
            for n in (1, K + 1):
                row[f"tp{len(group)}_T{n}_ms"] = forward_ms(eng, n, repeats)
    results.setdefault("timings", {})[label] = row
    log(f"  {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))


def synthetic(root: Path, size: str) -> Path:
    from support.tiny_models import make_tiny_checkpoint

    shapes = {
        "medium": dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=4096),
        "large": dict(hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=8192),
    }[size]
    return make_tiny_checkpoint(root / f"synthetic_{size}", "llama", seed=5, initializer_range=0.02, **shapes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one architecture, fewer repeats")
    ap.add_argument("--cpu", action="store_true", help="run on CPU ranks (gloo) to check the script")
    ap.add_argument("--synthetic", choices=("medium", "large"), help="also time a random model of this size")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads() // 2) if args.cpu else torch.get_num_threads())
    results: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    repeats = 10 if args.quick else 50
    archs = ["llama"] if args.quick else ["llama", "qwen2", "qwen3"]
    if args.cpu:
        gpus = []
    elif not torch.cuda.is_available():
        log("no CUDA device: nothing to check (use --cpu to exercise the script)")
        return 2
    else:
        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    ok = True
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ssdlocal_gpu_check_") as tmp:
        from support.tiny_models import make_tiny_suite

        log("building tiny checkpoints ...")
        dirs = make_tiny_suite(Path(tmp))
        log("1. inventory")
        check_inventory(results)
        n = 2 if args.cpu else tp_degree(len(gpus))
        tp_devices = ("cpu",) * 2 if args.cpu else tuple(gpus[:n])
        log(f"2. tensor-parallel exactness over {','.join(tp_devices)}")
        if len(tp_devices) > 1:
            ok &= check_tp_exact(dirs, tp_devices, archs, results)
        else:
            log("  skipped: one GPU (NCCL needs one GPU per rank)")
        log("3. SSD / SD == AR, draft in its own process")
        if args.cpu:
            ok &= check_ssd(dirs, tp_devices, "cpu", results)
        else:
            spare = gpus[n:] or gpus[:1]
            ok &= check_ssd(dirs, tp_devices, spare[0], results)
            if len(tp_devices) > 1:  # also the single-GPU target with the draft on the next GPU
                ok &= check_ssd(dirs, (gpus[0],), gpus[1], results)
        log("4. q channel")
        draft_dev = "cpu" if args.cpu else (gpus[n] if len(gpus) > n else gpus[0])
        ok &= check_channel(tp_devices[0], draft_dev, results, repeats)
        log("5. captured forwards == eager")
        ok &= check_graphs_exact(dirs, tp_devices[0] if args.cpu else gpus[0], results)
        log("6. per-forward latency (ms, median)")
        check_timings(dirs["llama"], tp_devices, "float32", "tiny llama fp32", results, repeats)
        if args.synthetic:
            path = synthetic(Path(tmp), args.synthetic)
            dtype = "float32" if args.cpu else "bfloat16"
            check_timings(path, tp_devices, dtype, f"synthetic {args.synthetic} {dtype}", results, repeats)
    results["ok"] = bool(ok)
    results["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps(results, indent=2))
    log(f"{'OK' if ok else 'FAILED'} in {results['wall_s']:.0f} s; results in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
