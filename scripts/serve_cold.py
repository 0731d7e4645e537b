"""A cold first prompt through `ssdlocal serve`, sent the moment it says it serves, against
plain llama-cpp-python reading the same token ids from the same GGUF (the built-in target).

    python scripts/serve_cold.py [--repeats 2] [--stream] NAME=CHECKOUT [NAME=CHECKOUT ...]

For each checkout (e.g. `before=/tmp/old after=.`, `PYTHONPATH` set to it) starts `python -m
ssdlocal serve` on a free port with every default, waits for its "serving" line, sends one
chat request (a system message holding 220 lines of ssdlocal/server/scheduler.py and a
question, about 2,300 tokens; temperature 0, `max_tokens` 1, or `--stream` without
`max_tokens`, timing the first streamed content), prints the server's own prefill tokens
per second and time to first token, and stops it; then plain llama-cpp-python (2 threads,
`n_batch` 512) reads the same ids in a process of its own. The checkouts and the plain
read alternate over `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "ssdlocal" / "server" / "scheduler.py"


def messages() -> list[dict]:
    src = "\n".join(SOURCE.read_text().splitlines()[:220])
    return [
        {"role": "system", "content": "You review code.\n```python\n" + src + "\n```"},
        {"role": "user", "content": "What does this file do?"},
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(name: str, checkout: str, stream: bool) -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=checkout)
    command = [sys.executable, "-m", "ssdlocal", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        started = time.perf_counter()
        while not (line := proc.stderr.readline()).startswith("serving "):
            if not line:
                raise SystemExit(f"{name}: serve exited")
        ready = time.perf_counter() - started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        fields = {"model": model, "messages": messages(), "temperature": 0}
        fields |= {"stream": True} if stream else {"max_tokens": 1}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(fields).encode(),
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as resp:
            if stream:
                for raw in resp:
                    line = raw.decode().strip()
                    if '"content": "' in line and '"content": ""' not in line:
                        break
                first = time.perf_counter() - t0
                print(f"{name}: serving after {ready:.1f} s; first streamed content after {first:.2f} s", flush=True)
                return
            reply = json.loads(resp.read())
        stats, n = reply["ssdlocal"], reply["usage"]["prompt_tokens"]
        print(
            f"{name}: serving after {ready:.1f} s; {n} prompt tokens read at {stats['prefill_tokens_per_s']:.1f} tok/s, "
            f"server ttft {stats['ttft_s']:.2f} s, request {time.perf_counter() - t0:.2f} s "
            f"(load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


PLAIN = """
import json, os, sys, time
from ssdlocal.backends.llamacpp import gguf_tokenizer
from ssdlocal.backends.llamacpp.lib import high_level_llama
from ssdlocal.engine.prompts import encode_messages
from ssdlocal.weights.assets import DEFAULT_TARGET, fetch_gguf

gguf = str(fetch_gguf(DEFAULT_TARGET))
ids = encode_messages(gguf_tokenizer(gguf), json.loads(sys.argv[1]))
llm = high_level_llama(model_path=gguf, n_ctx=len(ids) + 64, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
t0 = time.perf_counter()
llm.eval(ids)
dt = time.perf_counter() - t0
print(f"plain llama.cpp: {len(ids)} prompt tokens read at {len(ids) / dt:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="+", metavar="NAME=CHECKOUT")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream", action="store_true", help="stream without max_tokens (time the first content)")
    args = ap.parse_args()
    pairs = [c.split("=", 1) for c in args.checkouts]
    for repeat in range(args.repeats):
        for name, checkout in pairs:
            serve_once(f"{repeat} {name}", str(Path(checkout).resolve()), args.stream)
        subprocess.run([sys.executable, "-c", PLAIN, json.dumps(messages())], stderr=subprocess.DEVNULL, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
