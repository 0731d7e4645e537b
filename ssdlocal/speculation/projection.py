"""Projected SD / SSD speedups over AR at other draft/target latency ratios (pure math).

docs/architecture.md §1, latencies in units of one target step (one AR token); a
verification of K+1 tokens costs v such steps (1 for a dense model, whose step reads every
weight whatever the tokens; more for a mixture of experts, whose verification reads the
experts all its tokens chose: `verify_cost`, from the bytes each reads):
    SD round  = K draft forwards + 1 verify            -> speedup_SD  = E_SD / (v + K*r)
    SSD round = max(v, T_p) on a hit, v + T_b on a miss, with T_p = (K+1)*r
    speedup_SSD = (p_hit*E_hit + (1-p_hit)*E_miss) / (p_hit*max(v, T_p) + (1-p_hit)*(v + T_b))
where r = draft forward time / target step time and T_b = backup_forwards * r
(K for the neural jit backup, 0 for a fast n-gram / no backup); v = 1 gives the formulas of
§1. Besides the listed ratios and the measured one, a row for the ratio of the weight bytes
a draft step and a target step read (`bytes_ratio`, weights/size.py: what a memory-bound GPU
makes of them). These are projections from measured acceptance and hit rates, not
measurements.

E_hit is the measured SSD tokens per hit round, except where pre-speculation fits inside
one verification (T_p <= 1): there the worker completes all K steps, so a hit round
carries as many tokens as an SD round (E_SD, same draft and acceptance). Where the run
measured a slower draft (e.g. both models sharing a 2-core CPU) the measured E_hit
reflects trees cut short and would understate SSD on faster draft hardware.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_RATIOS = (0.02, 0.05, 0.1, 0.2, 0.35)


@dataclass(frozen=True)
class ProjectionInputs:
    """Measured quantities the projection is built from (None = mode not measured)."""

    k: int
    e_sd: float | None = None  # tokens per round in SD
    p_hit: float | None = None  # SSD cache hit rate (per row-round)
    e_hit: float | None = None  # SSD tokens per round on a hit
    e_miss: float | None = None  # SSD tokens per round on a miss
    backup_forwards: float = 0.0  # draft forwards a miss costs (K for jit)
    measured_ratio: float | None = None  # draft/target forward latency measured in this run
    bytes_ratio: float | None = None  # weight bytes a draft step reads / a target step's
    verify_cost: float = 1.0  # weight bytes a K+1-token verification reads / a one-token step's


def sd_speedup(e_sd: float, k: int, ratio: float, verify: float = 1.0) -> float:
    """SD over AR: E_SD tokens per round of K draft forwards plus one verification costing
    `verify` target steps."""
    return e_sd / (verify + k * ratio)


def ssd_speedup(
    p_hit: float, e_hit: float, e_miss: float, k: int, ratio: float, backup_forwards: float, verify: float = 1.0
) -> float:
    """SSD over AR by the speedup formula (docs/architecture.md §1) with T_p = (K+1)*ratio,
    T_b = backup_forwards*ratio and a verification of `verify` target steps."""
    t_p = (k + 1) * ratio
    t_b = backup_forwards * ratio
    tokens = p_hit * e_hit + (1.0 - p_hit) * e_miss
    time = p_hit * max(verify, t_p) + (1.0 - p_hit) * (verify + t_b)
    return tokens / time


def project(inputs: ProjectionInputs, ratios: tuple[float, ...] = DEFAULT_RATIOS) -> dict:
    """Projected speedups for each ratio (plus the measured one, if known).

    Returns {"label", "inputs", "rows": [{"ratio", "sd_speedup", "ssd_speedup", "measured",
    "from_bytes"}]}; a speedup is None when its mode was not measured. Ratios are sorted
    ascending.
    """
    known = [r for r in (inputs.measured_ratio, inputs.bytes_ratio) if r]
    all_ratios = sorted({*ratios, *known})
    e_miss = inputs.e_miss if inputs.e_miss is not None else inputs.e_sd
    v = inputs.verify_cost
    rows = []
    for r in all_ratios:
        sd = sd_speedup(inputs.e_sd, inputs.k, r, v) if inputs.e_sd else None
        ssd = None
        if inputs.p_hit is not None and inputs.e_hit is not None and e_miss is not None:
            full_depth = (inputs.k + 1) * r <= v and inputs.e_sd is not None
            e_hit = max(inputs.e_hit, inputs.e_sd) if full_depth else inputs.e_hit
            ssd = ssd_speedup(inputs.p_hit, e_hit, e_miss, inputs.k, r, inputs.backup_forwards, v)
        elif inputs.p_hit == 0.0 and e_miss is not None:  # never hit: E_hit is irrelevant
            ssd = ssd_speedup(0.0, 0.0, e_miss, inputs.k, r, inputs.backup_forwards, v)
        rows.append(
            {
                "ratio": r,
                "sd_speedup": sd,
                "ssd_speedup": ssd,
                "measured": r == inputs.measured_ratio,
                "from_bytes": r == inputs.bytes_ratio,
            }
        )
    return {
        "label": "projection (not measured): SSD speedup formula of docs/architecture.md §1, T_p = (K+1) draft forwards, "
        f"verify = {v:.2f} target steps (the weight bytes it reads), SD round = K draft forwards + 1 verify",
        "inputs": asdict(inputs),
        "rows": rows,
    }
