"""Where SSD's time goes on the real offline pair: verify vs draft busy vs waiting, per round.

Runs one prompt in SSD (auto fan-out; fixed K=4; K=2), SD and AR on one Engine and prints
tokens/s, tokens per round, cache hit rate, and per-round verify / draft-busy / wait times.
Needs the offline pair converted (run `ssdlocal generate --chat hi` once).
Usage: python scripts/ssd_time_split.py
"""

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.engine import Engine
from ssdlocal.weights.assets import ensure_default_pair
from ssdlocal.core.config import ModelDraft  # noqa: E402

T, D = (str(p) for p in ensure_default_pair())


def main():
    cfg = EngineConfig(
        target=ModelSpec(T, dtype="bfloat16"),
        spec=SpecConfig(mode=Mode.SSD, k=4, draft=ModelDraft(ModelSpec(D, dtype="bfloat16"))),
    )
    e = Engine(cfg)
    p = SamplingParams(max_new_tokens=64)
    prompt = "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals."
    list(e.generate(["warm up"], SamplingParams(max_new_tokens=8), chat=True))
    for label, spec in [
        ("ssd auto", SpecConfig(mode=Mode.SSD, k=4, draft=cfg.spec.draft)),
        (
            "ssd fixed 1,1,1,1,2 jit",
            SpecConfig(
                mode=Mode.SSD,
                k=4,
                draft=cfg.spec.draft,
                fan_out=(1, 1, 1, 1, 2),
                fan_out_miss=(1, 1, 1, 1, 2),
                backup="jit",
            ),
        ),
        (
            "ssd K=2 fixed 2,2,3 jit",
            SpecConfig(
                mode=Mode.SSD, k=2, draft=cfg.spec.draft, fan_out=(2, 2, 3), fan_out_miss=(2, 2, 3), backup="jit"
            ),
        ),
        ("sd", SpecConfig(mode=Mode.SD, k=4, draft=cfg.spec.draft)),
        ("ar", SpecConfig(mode=Mode.AR)),
    ]:
        s = list(e.generate([prompt], p, chat=True, spec=spec))[-1].stats
        r = s["rounds"]
        print(
            f"{label:26s} {s['tokens_per_s']:.2f} tok/s  tok/round {s['mean_accepted_len']:.2f}  hit {s.get('cache_hit_rate')}  "
            f"wait-for-draft {s['draft_ms'] / r:.0f} ms/rnd  verify {s['verify_ms'] / r:.0f} ms/rnd  draft busy {s.get('draft_busy_ms', 0) / r:.0f} ms/rnd",
            flush=True,
        )
    e.close()


if __name__ == "__main__":
    main()
