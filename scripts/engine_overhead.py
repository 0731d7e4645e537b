"""Engine overhead per round on tiny checkpoints: round wall time minus model forward time.

Builds the test suite's tiny Llama checkpoints (tests/tiny_models.py) in /tmp once, then
runs AR and SD (K=4) twice each and prints ms of non-model work per round.
Usage: python scripts/engine_overhead.py
"""
import sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pathlib import Path
from tiny_models import make_tiny_suite
root = Path("/tmp/ssdlocal-tiny-suite")
d = {p.name: p for p in root.iterdir()} if (root / "llama").exists() else make_tiny_suite(root)
from ssdlocal.core.config import *
from ssdlocal.engine import Engine
from ssdlocal.core.events import DoneEvent
from ssdlocal.backends.torch import runner as runner_mod

def main():
    torch.set_num_threads(1)
    cfg = EngineConfig(target=ModelSpec(str(d["llama"])), spec=SpecConfig(mode=Mode.SD, k=4, draft=str(d["draft_llama"])),
                       draft_model=ModelSpec(str(d["draft_llama"])))
    eng = Engine(cfg)
    # time spent inside model forwards (target and draft) via a wrapper on ModelRunner.feed/forward_raw
    spent = {"fwd": 0.0}
    from ssdlocal.backends.torch import model as model_mod
    orig = model_mod.Transformer.forward
    def timed(self, *a, **k):
        t = time.perf_counter(); out = orig(self, *a, **k); spent["fwd"] += time.perf_counter() - t; return out
    model_mod.Transformer.forward = timed
    p = SamplingParams(max_new_tokens=200, ignore_eos=True)
    for mode in ("ar", "sd", "ar", "sd"):
        spec = SpecConfig(mode=Mode(mode), k=4, draft=str(d["draft_llama"]))
        spent["fwd"] = 0.0
        t0 = time.perf_counter()
        evs = list(eng.generate(["hello world, def foo(x):"], p, spec=spec))
        wall = time.perf_counter() - t0
        s = evs[-1].stats
        rounds = s["rounds"] + 1
        print(f"{mode}: {rounds} rounds, wall {wall*1e3:.1f} ms, in model forward {spent['fwd']*1e3:.1f} ms, "
              f"engine overhead {(wall - spent['fwd'])/rounds*1e3:.3f} ms/round, {s['tokens_per_s']:.0f} tok/s")
    eng.close()

if __name__ == "__main__":
    main()
