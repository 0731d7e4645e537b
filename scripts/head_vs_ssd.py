"""What SSD could win with a draft head, from the product's own per-round costs.

SSD hides the drafting of a round behind the target's verification: at best a round
costs the verify alone instead of draft + verify, so with equal acceptance its speed-up
over SD is bounded by (draft + verify) / verify. This script measures draft and verify
time per round on the offline pair's target (Qwen2.5-Coder-1.5B, bf16) for two drafters
of the same K:
- an EAGLE-3 head of a published head's shape for this width (one decoder layer of
  12 heads / 2 kv heads / 8,960 MLP, fused hidden states of layers 2, 14 and 25, a
  32,000-token draft vocabulary), random weights (its costs do not depend on them; its
  acceptance does, so tokens per second of that run mean nothing);
- the pair's draft model (Qwen2.5-Coder-0.5B).
It prints each drafter's draft and verify ms per round and the SSD bound that follows.
Needs the offline pair (run `ssdlocal generate --chat hi` once).
Usage: python scripts/head_vs_ssd.py [--k 4] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.tiny_heads import make_eagle3  # noqa: E402

from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.core.events import DoneEvent  # noqa: E402
from ssdlocal.core.models import HeadDraft  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402
from ssdlocal.weights.assets import ensure_default_pair  # noqa: E402

PROMPT = "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals."


def head_for(engine: Engine, root: Path) -> Path:
    """A random EAGLE-3 head of a published head's shape for the engine's target."""
    args = engine.runner.model.args
    target = root / "target-config"
    target.mkdir()
    config = {"hidden_size": args.hidden_size, "vocab_size": args.vocab_size, "max_position_embeddings": 32768}
    (target / "config.json").write_text(json.dumps(config))
    layers = args.num_layers
    aux = (2, layers // 2, layers - 3)
    return make_eagle3(root / "head", target, draft_vocab=32000, aux=aux, heads=12, kv=2, inter=8960)


def per_round(engine: Engine, spec: SpecConfig, tokens: int) -> tuple[float, float, float]:
    """(draft ms, verify ms, tokens per round) per round of one greedy answer."""
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    done = [e for e in engine.generate([PROMPT], params, chat=True, spec=spec) if isinstance(e, DoneEvent)][0]
    s = done.stats
    rounds = max(s["rounds"], 1)
    return s["draft_ms"] / rounds, s["verify_ms"] / rounds, s["mean_accepted_len"] or 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    opts = ap.parse_args()
    target, draft = (str(p) for p in ensure_default_pair())
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text()]
    print(f"# {platform.processor() or platform.machine()}, flags {' '.join(flags)}, K={opts.k}, bf16")
    with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(target=ModelSpec(target, dtype="bfloat16"))) as e:
        head = head_for(e, Path(tmp))
        drafters = {
            "eagle3 head": SpecConfig(mode=Mode.SD, k=opts.k, draft=HeadDraft(str(head))),
            "0.5B model": SpecConfig(mode=Mode.SD, k=opts.k, draft=ModelDraft(ModelSpec(draft, dtype="bfloat16"))),
        }
        for spec in drafters.values():  # load and warm each once
            per_round(e, spec, 8)
        print("| drafter | draft ms/round | verify ms/round | draft share | SSD bound over SD |")
        print("|---|---|---|---|---|")
        for name, spec in drafters.items():
            runs = [per_round(e, spec, opts.tokens) for _ in range(opts.repeats)]
            d = sorted(r[0] for r in runs)[len(runs) // 2]
            v = sorted(r[1] for r in runs)[len(runs) // 2]
            print(f"| {name} | {d:.1f} | {v:.1f} | {d / (d + v):.0%} | {(d + v) / v:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
