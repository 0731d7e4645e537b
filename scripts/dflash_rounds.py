"""A DFlash block drafter on tiny checkpoints: acceptance against transformers' own DFlash
assisted generation, and the drafter's cost per round against an EAGLE-3 head drafting
the same K.

Builds the test suite's tiny Llama target (tests/support/tiny_models.py) in /tmp once.

1. Acceptance: a block-4 drafter trained as tests/test_dflash.py trains it (about 5 s) on
   the target's answers to four prompts; each prompt then runs greedy through
   transformers (`generate(assistant_model=..., speculation_type="dflash")`) and through
   ssdlocal (SD, K = 3, the four rows in one batch): drafts accepted per round, both runs.
2. Cost: for each K, a DFlash drafter of block K + 1 (1 and 5 layers: published drafters
   have 5) and an EAGLE-3 head (1 layer), random weights, one row, 128 new tokens, one
   torch thread, `--repeats` runs interleaved: the drafter's milliseconds per round
   (propose, plus observe: the context write / catch-up after the verify), medians.

    PYTHONPATH=tests python scripts/dflash_rounds.py [--repeats 3] [--ks 3,7,15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from support.tiny_dflash import make_dflash, train_dflash, transformers_rounds  # noqa: E402
from support.tiny_heads import make_eagle3  # noqa: E402
from support.tiny_models import make_tiny_suite  # noqa: E402

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.core.events import DoneEvent, RoundEvent  # noqa: E402
from ssdlocal.core.models import HeadDraft  # noqa: E402
from ssdlocal.draft.block import BlockDrafter  # noqa: E402
from ssdlocal.draft.head import HeadDrafter  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402

SUITE = Path("/tmp/ssdlocal-tiny-suite")
WORK = Path("/tmp/ssdlocal-dflash-rounds")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time there was a little model",
    "Speculative decoding lets a small draft model",
]


def acceptance(target: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(t).input_ids[:5] for t in TEXTS]
    drafter = make_dflash(WORK / "trained", target, block_size=4, target_layer_ids=(0, 1))
    train_dflash(drafter, target, prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    ours: list[list[int]] = [[] for _ in prompts]
    config = EngineConfig(target=ModelSpec(str(target), dtype="float32"), prefix_cache_tokens=0)
    with Engine(config) as engine:
        spec = SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(drafter), "dflash"))
        for ev in engine.generate(prompts, params, spec=spec):
            if isinstance(ev, RoundEvent):
                for b, a in zip(ev.rows, ev.n_accepted):
                    ours[b].append(a)
            elif isinstance(ev, DoneEvent):
                done = ev
    print("acceptance, greedy, K = 3 (drafts accepted per round)")
    for b, prompt in enumerate(prompts):
        tokens, rounds = transformers_rounds(target, drafter, prompt, 24)
        held = sorted(rounds)
        theirs = [after - before - 1 for before, after in zip(held, held[1:])]
        same = list(done.outputs[b].token_ids) == tokens
        print(f"  prompt {b}: transformers {theirs}")
        print(
            f"            ssdlocal     {ours[b][: len(theirs)]}  (+{len(ours[b]) - len(theirs)}: the last round, cut at the length limit)"
        )
        print(
            f"            same answer: {same}; rate {sum(theirs) / (3 * len(theirs)):.3f} vs {sum(ours[b][: len(theirs)]) / (3 * len(theirs)):.3f}"
        )


def costs(target: Path, ks: list[int], repeats: int) -> None:
    spent = {"ms": 0.0, "rounds": 0}
    for cls in (BlockDrafter, HeadDrafter):
        for name in ("propose", "observe"):
            original = getattr(cls, name)

            def timed(self, *a, _original=original, _name=name, **k):
                t = time.perf_counter()
                out = _original(self, *a, **k)
                spent["ms"] += 1000 * (time.perf_counter() - t)
                spent["rounds"] += _name == "propose"
                return out

            setattr(cls, name, timed)
    drafters = {}
    for k in ks:
        drafters[f"dflash 1 layer, K={k}"] = (make_dflash(WORK / f"b{k}l1", target, block_size=k + 1, layers=1), k)
        drafters[f"dflash 5 layers, K={k}"] = (make_dflash(WORK / f"b{k}l5", target, block_size=k + 1, layers=5), k)
        drafters[f"eagle3 1 layer, K={k}"] = (make_eagle3(WORK / "eagle3", target), k)
    kinds = {name: ("dflash" if name.startswith("dflash") else "eagle3") for name in drafters}
    params = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    per_round: dict[str, list[float]] = {name: [] for name in drafters}
    config = EngineConfig(target=ModelSpec(str(target), dtype="float32"), prefix_cache_tokens=0)
    with Engine(config) as engine:
        for _ in range(repeats):
            for name, (path, k) in drafters.items():
                spent.update(ms=0.0, rounds=0)
                spec = SpecConfig(mode=Mode.SD, k=k, draft=HeadDraft(str(path), kinds[name]))
                list(engine.generate([TEXTS[0]], params, spec=spec))
                per_round[name].append(spent["ms"] / spent["rounds"])
    print(f"drafter ms per round (propose + observe), 1 row, median of {repeats}")
    for name, values in per_round.items():
        print(f"  {name:24s} {statistics.median(values):7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="3,7,15")
    args = ap.parse_args()
    dirs = {p.name: p for p in SUITE.iterdir()} if (SUITE / "llama").exists() else make_tiny_suite(SUITE)
    torch.set_num_threads(1)
    acceptance(dirs["llama"])
    costs(dirs["llama"], [int(k) for k in args.ks.split(",")], args.repeats)


if __name__ == "__main__":
    main()
