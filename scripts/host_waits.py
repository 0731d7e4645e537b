"""Host waits per round by mode on the test suite's tiny Llama pair: AR, SD (the draft model,
K=4), SD with n-gram proposals and SSD, float32, greedy, 48 new tokens, one torch thread.

Prints, per mode, the rounds and each model's stream synchronisations per round (the
engine's `host_waits` stats: the target's, the draft's, the SSD worker's). Runs the package
it imports first, so an older checkout can be compared on the same venv:

    PYTHONPATH=.:tests python scripts/host_waits.py
    PYTHONPATH=/path/to/older/checkout:tests python scripts/host_waits.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from support.tiny_models import make_tiny_suite

import ssdlocal
from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, NgramDraft, SamplingParams, SpecConfig
from ssdlocal.engine import Engine

SUITE = Path("/tmp/ssdlocal-tiny-suite")
PROMPT = "hello world, def foo(x):"


def main() -> None:
    dirs = {p.name: p for p in SUITE.iterdir()} if (SUITE / "llama").exists() else make_tiny_suite(SUITE)
    torch.set_num_threads(1)
    draft = ModelDraft(ModelSpec(str(dirs["draft_llama"]), dtype="float32"), suffix=None)
    target = ModelSpec(str(dirs["llama"]), dtype="float32")
    cfg = EngineConfig(target=target, spec=SpecConfig(mode=Mode.SSD, k=4, draft=draft))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    specs = {
        "ar": SpecConfig(mode=Mode.AR),
        "sd": SpecConfig(mode=Mode.SD, k=4, draft=draft),
        "sd-ngram": SpecConfig(mode=Mode.SD, k=4, draft=NgramDraft()),
        "ssd": SpecConfig(mode=Mode.SSD, k=4, draft=draft),
    }
    print(f"package: {Path(ssdlocal.__file__).parent}")
    with Engine(cfg) as engine:
        for name, spec in specs.items():
            stats = list(engine.generate([PROMPT], params, spec=spec))[-1].stats
            waits = {model: round(w["waits_per_round"], 2) for model, w in (stats.get("host_waits") or {}).items()}
            print(f"{name:9s} rounds {stats['rounds']:3d}  waits per round {waits}")


if __name__ == "__main__":  # the SSD worker is a spawned process: it imports this module
    main()
