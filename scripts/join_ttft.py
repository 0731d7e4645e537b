"""Time to the first token of a short request sent while a long answer streams.

    SSDLOCAL_KEEP_MEASUREMENTS=1 python scripts/join_ttft.py [--modes ar,sd,ssd] [--pair NAME]

For each mode: starts `ssdlocal serve --pair PAIR --mode MODE` on a free port (the
`ssdlocal` PYTHONPATH names, else the installed one: point it at another checkout to
compare code; the server runs in "/" so the working directory does not count), waits for
/health, streams a long completion (`--long-tokens`, temperature 0, ignore_eos), and once
it has streamed `--after` chunks sends a short one (`--short-tokens`, streamed too).
Prints per mode: the short request's time to its first token and to its end (client side),
how many chunks of the long answer were still to come when the short one ended, and the
long answer's own wall time, and the longest gap between two of the long answer's chunks
while the short request was served (how long the running answer stalled for the join).
`--join-prompt-tokens N` makes the short request's prompt a code file of about N tokens
(a new one each time, so the prefix cache does not hold it). `--repeats` runs the pair of requests that many times per
server (the first warms up the prefix cache and the calibration) and prints the median.
Set SSDLOCAL_KEEP_MEASUREMENTS=1 so the servers reuse their calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

LONG = "Write a Python module that implements a binary search tree with insert, delete and an in-order walk."
SHORT = "def add(a, b):"
CODE = "def f{i}(values):\n    total = 0\n    for v in values:\n        total += v * {i}\n    return total\n\n"


def join_prompt(tokens: int, run: int) -> str:
    """A code file of about `tokens` tokens (about 8 per line here), new for every `run`."""
    head = f"# module {run} of {time.time_ns()}\n"
    return head + "".join(CODE.format(i=i) for i in range(max(1, tokens // 40))) + SHORT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def stream(url: str, prompt: str, tokens: int, on_chunk, usage: dict | None = None) -> None:
    """A streamed completion; on_chunk(time) per chunk that carries text; the final usage into `usage`."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("choices"):
                on_chunk(time.perf_counter())
            elif usage is not None and data.get("usage"):
                usage.update(data["usage"])


def one_pair(url: str, args, run: int = 0) -> dict:
    long_chunks: list[float] = []
    started = threading.Event()

    def on_long(at: float) -> None:
        long_chunks.append(at)
        if len(long_chunks) >= args.after:
            started.set()

    t_long = time.perf_counter()
    thread = threading.Thread(target=stream, args=(url, LONG, args.long_tokens, on_long), daemon=True)
    thread.start()
    if not started.wait(1800):
        raise RuntimeError("the long answer did not start")
    short_chunks: list[float] = []
    usage: dict = {}
    prompt = join_prompt(args.join_prompt_tokens, run) if args.join_prompt_tokens else SHORT
    t0 = time.perf_counter()
    stream(url, prompt, args.short_tokens, short_chunks.append, usage)
    short_end = time.perf_counter()
    thread.join()
    during = [at for at in long_chunks if t0 <= at <= short_end]
    before = [at for at in long_chunks if at < t0][-1:]
    gaps = [b - a for a, b in zip(before + during, during)]
    return {
        "short_prompt_tokens": usage.get("prompt_tokens", 0),
        "long_max_gap_s": max(gaps, default=short_end - (before or [t0])[0]),
        "short_ttft_s": short_chunks[0] - t0,
        "short_total_s": short_end - t0,
        "long_chunks_after_short": sum(1 for at in long_chunks if at > short_end),
        "long_total_s": long_chunks[-1] - t_long,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b-offline")
    ap.add_argument("--long-tokens", type=int, default=300)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--after", type=int, default=10, help="long-answer chunks before the short request is sent")
    ap.add_argument("--join-prompt-tokens", type=int, default=0, help="the short request's prompt: a file of ~N tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", dest="as_json", action="store_true")
    args = ap.parse_args()
    results = {}
    for mode in args.modes.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "ssdlocal",
            "serve",
            "--pair",
            args.pair,
            "--mode",
            mode,
            "--port",
            str(port),
            "--served-model-name",
            "m",
        ]
        # cwd "/": `python -m` puts the working directory first on the path; PYTHONPATH decides
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ), cwd="/"
        )
        try:
            wait_healthy(url, proc, 1800)
            runs = [one_pair(url, args, run) for run in range(args.repeats)]
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        results[mode] = {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"runs": runs}
        if not args.as_json:
            m = results[mode]
            print(
                f"{mode:4} short ttft {m['short_ttft_s']:7.2f} s  short total {m['short_total_s']:7.2f} s  "
                f"({m['short_prompt_tokens']:.0f} prompt tokens)  long stalled at most {m['long_max_gap_s']:6.2f} s  "
                f"long chunks after it {m['long_chunks_after_short']:5.0f}  long total {m['long_total_s']:7.1f} s",
                flush=True,
            )
    if args.as_json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
