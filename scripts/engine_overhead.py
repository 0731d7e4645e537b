"""Engine overhead per round on tiny checkpoints: round wall time minus model forward time.

Builds the test suite's tiny Llama checkpoints (tests/support/tiny_models.py) in /tmp once, then
runs AR, SD (K=4, the draft model's drafts), SD with suffix proposals weighed per row, and
SD with K chosen per round, `--repeats` times each, interleaved, one torch thread, 200 new
tokens, and prints the median milliseconds of non-model work per round.

    PYTHONPATH=tests python scripts/engine_overhead.py [--repeats 5] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from support.tiny_models import make_tiny_suite  # noqa: E402

from ssdlocal.backends.torch.models import base as model_mod  # noqa: E402
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig  # noqa: E402
from ssdlocal.engine import Engine  # noqa: E402
from ssdlocal.core.config import ModelDraft  # noqa: E402

SUITE = Path("/tmp/ssdlocal-tiny-suite")
PROMPT = "hello world, def foo(x):"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    dirs = {p.name: p for p in SUITE.iterdir()} if (SUITE / "llama").exists() else make_tiny_suite(SUITE)
    torch.set_num_threads(1)
    draft = str(dirs["draft_llama"])
    cfg = EngineConfig(
        target=ModelSpec(str(dirs["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=4, draft=ModelDraft(ModelSpec(draft, dtype="float32"))),
    )
    spent = {"forward": 0.0}
    forward = model_mod.CausalLM.forward

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = forward(self, *a, **k)
        spent["forward"] += time.perf_counter() - t
        return out

    model_mod.CausalLM.forward = timed
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    model_only = ModelDraft(cfg.spec.draft.model, suffix=None)
    specs = {  # sd: the draft model's K drafts every round, as before K per round existed
        "ar": SpecConfig(mode=Mode.AR),
        "sd": SpecConfig(mode=Mode.SD, k=4, draft=model_only),
        "sd+suffix": SpecConfig(mode=Mode.SD, k=4, draft=cfg.spec.draft),  # each row's suffix proposal weighed too
        "sd, K per round": SpecConfig(mode=Mode.SD, k=12, adaptive_k=True, draft=cfg.spec.draft),
    }
    results: dict[str, list[float]] = {name: [] for name in specs}
    with Engine(cfg) as engine:
        for _ in range(args.repeats + 1):  # the first pass warms up
            for mode, spec in specs.items():
                spent["forward"] = 0.0
                t0 = time.perf_counter()
                events = list(engine.generate([PROMPT] * args.batch, params, spec=spec))
                wall = time.perf_counter() - t0
                rounds = events[-1].stats["rounds"] + 1  # + the prefill
                results[mode].append((wall - spent["forward"]) / rounds * 1e3)
    for mode, values in results.items():
        values = values[1:]
        print(
            f"{mode}: engine overhead {statistics.median(values):.3f} ms/round "
            f"(median of {len(values)}, min {min(values):.3f}, max {max(values):.3f})"
        )


if __name__ == "__main__":
    main()
