"""Server overhead on tiny checkpoints: one request through `ssdlocal serve` vs the same
Engine called directly (what `generate` does after loading), per mode.

Builds the test suite's tiny Llama checkpoints (tests/support/tiny_models.py) in /tmp once, then
for AR, SD (draft model, K=4) and SSD starts one engine and serves it on 127.0.0.1 (a
free port, uvicorn in a thread); interleaves `--repeats` direct `Engine.generate` calls
and HTTP requests (non-streamed and streamed, temperature 0, `--tokens` new tokens,
ignore_eos) and prints medians: wall milliseconds per request and decode tokens/s
(the engine's own figure for direct calls, the response's `ssdlocal.tokens_per_s` for
the server). Also 8 concurrent streamed requests: total wall time vs 8 sequential.

    PYTHONPATH=tests python scripts/serve_overhead.py [--repeats 5] [--tokens 128] [--modes ar,sd,ssd]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from support.server import MODEL, LiveServer
from support.tiny_models import make_tiny_suite

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.events import DoneEvent
from support.drafts import draft_of  # noqa: E402

SUITE = Path("/tmp/ssdlocal-tiny-suite")
PROMPT = "hello world, def foo(x):"


def direct(live: LiveServer, tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    done = next(ev for ev in live.engine.generate([PROMPT], params) if isinstance(ev, DoneEvent))
    return (time.perf_counter() - t0) * 1e3, done.stats["tokens_per_s"]


def http(live: LiveServer, tokens: int, stream: bool) -> tuple[float, float]:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    req = urllib.request.Request(
        f"{live.url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    wall = (time.perf_counter() - t0) * 1e3
    if not stream:
        return wall, json.loads(raw)["ssdlocal"]["tokens_per_s"]
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return wall, next(c["ssdlocal"] for c in chunks if "ssdlocal" in c)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="ar,sd,ssd")
    args = ap.parse_args()
    dirs = {p.name: p for p in SUITE.iterdir()} if (SUITE / "llama").exists() else make_tiny_suite(SUITE)
    torch.set_num_threads(1)
    draft = str(dirs["draft_llama"])
    print(f"{'mode':5} {'path':14} {'wall ms':>9} {'tok/s':>8}")
    for mode in args.modes.split(","):
        config = EngineConfig(
            target=ModelSpec(str(dirs["llama"]), dtype="float32"),
            spec=SpecConfig(mode=Mode(mode), k=4, draft=draft_of(None if mode == "ar" else draft)),
            pin_cpus=False,
        )
        live = LiveServer(config)
        live.scheduler.batch_wait_s = 0.005  # the CLI's default gathering window
        try:
            results = {"direct": [], "server": [], "server stream": []}
            direct(live, 8), http(live, 8, False)  # warm-up
            for _ in range(args.repeats):
                results["direct"].append(direct(live, args.tokens))
                results["server"].append(http(live, args.tokens, False))
                results["server stream"].append(http(live, args.tokens, True))
            for path, runs in results.items():
                wall = statistics.median(r[0] for r in runs)
                tps = statistics.median(r[1] for r in runs)
                print(f"{mode:5} {path:14} {wall:9.1f} {tps:8.1f}")
            t0 = time.perf_counter()
            for _ in range(8):
                http(live, args.tokens, True)
            sequential = time.perf_counter() - t0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda _, live=live: http(live, args.tokens, True), range(8)))
            together = time.perf_counter() - t0
            print(
                f"{mode:5} 8 streams: sequential {sequential:.2f} s, concurrent {together:.2f} s "
                f"({sequential / together:.2f}x)"
            )
        finally:
            live.close()


if __name__ == "__main__":
    main()
