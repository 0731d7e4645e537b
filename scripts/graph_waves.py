"""Captured graphs per wave of served requests, with the CPU twin of CUDA graphs.

    PYTHONPATH=tests python scripts/graph_waves.py [--waves 3] [--mode sd] [--k 4]

Serves three waves of the same six staggered requests (each joins when the one before it
has 3 tokens) through `Engine.serve` on the test suite's tiny checkpoints, once with
`SSDLOCAL_GRAPHS=trace` (traced graphs: a replay runs the traced op graph, never the Python
step, as a CUDA graph would) and once with graphs off, and prints per wave the graphs the
target and the draft model captured and whether every request's tokens equal the eager
engine's. A server captures its common steps at start (engine/warm.py, counted apart) and,
its graphs living as long as it does, nothing after its first wave.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = [
    "The quick brown fox",
    "hello world, def foo(x):",
    "Once upon a time there was",
    "the cat sat on the mat, the cat",
    "x = 1",
    "a b c d e f g h i j k l m n o p",
]


def wave(engine, spec, first_id: int, new_tokens: int) -> dict[int, list[int]]:
    """Six requests, each joining once the one before it has 3 tokens."""
    from ssdlocal.core.config import SamplingParams
    from ssdlocal.core.events import SeatedEvent, TokensEvent
    from ssdlocal.engine.request import Inbox, Request

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    requests = [Request(tuple(engine.encode(p, chat=False)), params, id=first_id + i) for i, p in enumerate(PROMPTS)]
    inbox = Inbox()
    inbox.add(requests[0])
    waiting = list(requests[1:])
    tokens: dict[int, list[int]] = {r.id: [] for r in requests}
    finished: set[int] = set()
    seated: list[int] = []
    for event in engine.serve(inbox, max_batch=8, spec=spec):
        if isinstance(event, SeatedEvent):
            seated = list(event.requests)
        elif isinstance(event, TokensEvent):
            rid = seated[event.row]
            tokens[rid] += event.token_ids
            if event.finish_reason is not None:
                finished.add(rid)
        previous = requests[len(requests) - len(waiting) - 1] if waiting else None
        if previous is not None and len(tokens[previous.id]) >= 3:
            inbox.add(waiting.pop(0))
        if not waiting and finished >= set(tokens):
            inbox.close()
    return {rid - first_id: t for rid, t in tokens.items()}


def captured(engine) -> tuple[int, int]:
    counts = []
    for runner in (engine.runner, engine.parts.drafts.runner):
        cache = getattr(runner, "graphs", None) if runner is not None else None
        counts.append(cache.stats.captured if cache is not None else 0)
    return counts[0], counts[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--mode", default="sd", choices=("ar", "sd"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("SSDLOCAL_KEEP_MEASUREMENTS", "0")
    import torch

    from support.drafts import draft_of
    from support.tiny_models import make_tiny_suite

    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
    from ssdlocal.engine import Engine
    from ssdlocal.engine.warm import warm_up

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_tiny_suite(Path(tmp))
        draft = draft_of(str(dirs["draft_llama"]), suffix=False)
        spec = SpecConfig(mode=Mode(args.mode), k=args.k, draft=draft)
        results = {}
        for graphs in ("off", "trace"):
            os.environ["SSDLOCAL_GRAPHS"] = graphs
            config = EngineConfig(target=ModelSpec(str(dirs["llama"]), dtype="float32"), spec=spec, pin_cpus=False)
            with Engine(config) as engine:
                warm_up(engine.parts, spec, 8)  # what Engine.serve does first (engine/warm.py)
                before = captured(engine)
                print(f"graphs={graphs}: at start (warm-up) target {before[0]}, draft {before[1]} captured")
                waves = []
                for w in range(args.waves):
                    out = wave(engine, spec, 100 * (w + 1), args.new_tokens)
                    now = captured(engine)
                    waves.append((out, now[0] - before[0], now[1] - before[1]))
                    before = now
                results[graphs] = waves
        for w, ((want, _, _), (got, target, draft_n)) in enumerate(zip(results["off"], results["trace"])):
            print(f"wave {w + 1}: target {target}, draft {draft_n} graphs captured; tokens equal eager: {got == want}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
