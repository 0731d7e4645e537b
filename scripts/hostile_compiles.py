"""RSS and CPU of an idle server after concurrent hostile grammar compiles (issue 33, item 6).

    python scripts/hostile_compiles.py --target TINY_CHECKPOINT_DIR [--repo CHECKOUT]

Starts `python -m ssdlocal serve` from CHECKOUT (default: this one) on a small model in AR,
sends 3 rounds of 6 concurrent chat requests whose response_format schema compiles slowly,
then samples the server's process tree (the server and its children: CPU seconds, RSS,
threads) over 30 s of idleness, and checks that a plain request is still answered. No
real pattern compiles past the 5 s limit with llguidance 1.9.1 on the machines measured,
so the slow compile is simulated: a sitecustomize (loaded in the server and in every
Python child it starts) makes a grammar holding "SLOWCOMPILE" run 20 s of CPU that
releases the GIL and hold 300 MB before compiling, as an uninterruptible compile would.
Run it with --repo pointing at an older checkout to compare.
"""

SITECUSTOMIZE = '# Measurement aid (issue 33 item 6): when SSDLOCAL_HOSTILE_COMPILE=1, a grammar whose text\n# holds SLOWCOMPILE compiles for 20 s of GIL-free CPU holding 300 MB, as an uninterruptible\n# llguidance compile would. Loaded in every Python process of the run (spawned children too).\nimport os\nif os.environ.get("SSDLOCAL_HOSTILE_COMPILE") == "1":\n    import hashlib, time\n    import ssdlocal.grammar.compiler as _c\n    _real = _c.GrammarCompiler._compile\n    def _compile(self, kind, text, key, ll_tokenizer):\n        if "SLOWCOMPILE" in text:\n            hold = bytearray(300 << 20)\n            for i in range(0, len(hold), 4096):\n                hold[i] = 1\n            end = time.time() + 20\n            while time.time() < end:\n                hashlib.pbkdf2_hmac("sha256", b"x", b"y", 200_000)  # releases the GIL\n        return _real(self, kind, text, key, ll_tokenizer)\n    _c.GrammarCompiler._compile = _compile\n'

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument(
    "--repo",
    default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    help="the checkout whose server to measure (default: this one)",
)
parser.add_argument("--target", required=True, help="a small checkpoint directory")
parser.add_argument("--port", type=int, default=18733)
args = parser.parse_args()
repo, port = args.repo, args.port
site_dir = tempfile.mkdtemp(prefix="hostile_site_")
with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
    f.write(SITECUSTOMIZE)
env = dict(os.environ, PYTHONPATH=f"{site_dir}:{repo}", SSDLOCAL_HOSTILE_COMPILE="1", OMP_NUM_THREADS="1")
server = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "ssdlocal",
        "serve",
        "--target",
        args.target,
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--mode",
        "ar",
        "--served-model-name",
        "m",
    ],
    cwd=repo,
    env=env,
    stdout=open(os.path.join(site_dir, "serve.log"), "w"),
    stderr=subprocess.STDOUT,
)


def post(body, timeout=120):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def tree(pid):
    pids = [pid]
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().split(") ")[1].split()[1]) == pid:
                    pids += tree(int(p))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return pids


def sample(pid):
    cpu = rss = threads = 0
    pids = tree(pid)
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().split(") ")[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            status = open(f"/proc/{p}/status").read()
            rss += int(status.split("VmRSS:")[1].split()[0]) / 1024
            threads += int(status.split("Threads:")[1].split()[0])
        except (FileNotFoundError, IndexError):
            pass
    return cpu, rss, threads, len(pids)


for _ in range(120):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        break
    except Exception:
        time.sleep(1)
print(
    "ready",
    post(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "response_format": {"type": "json_object"},
        }
    )[0],
)
time.sleep(10)  # warm-up settles
cpu, rss, threads, procs = sample(server.pid)
print(f"before: rss {rss:.0f} MB, threads {threads}, processes {procs}")
for rnd in range(3):
    results = []

    def one(i):
        schema = {"type": "object", "title": f"SLOWCOMPILE {rnd} {i}", "properties": {"a": {"type": "string"}}}
        t = time.time()
        status, body = post(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            }
        )
        results.append((status, body.get("error", {}).get("code"), round(time.time() - t, 1)))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print("round", rnd, sorted(results))
t0 = time.time()
c0, r0, th0, p0 = sample(server.pid)
time.sleep(30)
c1, r1, th1, p1 = sample(server.pid)
print(
    f"idle 30 s after the rounds: CPU {c1 - c0:.1f} s, rss {r0:.0f} -> {r1:.0f} MB, threads {th0} -> {th1}, processes {p1}"
)
s, _ = post({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
print("plain request after:", s)
server.terminate()
server.wait(30)
