"""Projected SD / SSD speedups over AR at other draft/target latency ratios (pure math).

docs/architecture.md §1, latencies in units of one target verification (taken = one AR step):
    SD round  = K draft forwards + 1 verify            -> speedup_SD  = E_SD / (1 + K*r)
    SSD round = max(1, T_p) on a hit, 1 + T_b on a miss, with T_p = (K+1)*r
    speedup_SSD = (p_hit*E_hit + (1-p_hit)*E_miss) / (p_hit*max(1, T_p) + (1-p_hit)*(1 + T_b))
where r = draft forward time / target forward time and T_b = backup_forwards * r
(K for the neural jit backup, 0 for a fast n-gram / no backup). These are projections
from measured acceptance and hit rates, not measurements.

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


def sd_speedup(e_sd: float, k: int, ratio: float) -> float:
    """SD over AR: E_SD tokens per round of K draft forwards plus one verification."""
    return e_sd / (1.0 + k * ratio)


def ssd_speedup(p_hit: float, e_hit: float, e_miss: float, k: int, ratio: float, backup_forwards: float) -> float:
    """SSD over AR by the speedup formula (docs/architecture.md §1) with T_p = (K+1)*ratio and T_b = backup_forwards*ratio."""
    t_p = (k + 1) * ratio
    t_b = backup_forwards * ratio
    tokens = p_hit * e_hit + (1.0 - p_hit) * e_miss
    time = p_hit * max(1.0, t_p) + (1.0 - p_hit) * (1.0 + t_b)
    return tokens / time


def project(inputs: ProjectionInputs, ratios: tuple[float, ...] = DEFAULT_RATIOS) -> dict:
    """Projected speedups for each ratio (plus the measured one, if known).

    Returns {"label", "inputs", "rows": [{"ratio", "sd_speedup", "ssd_speedup", "measured"}]};
    a speedup is None when its mode was not measured. Ratios are sorted ascending.
    """
    all_ratios = sorted({*ratios, *([inputs.measured_ratio] if inputs.measured_ratio else [])})
    e_miss = inputs.e_miss if inputs.e_miss is not None else inputs.e_sd
    rows = []
    for r in all_ratios:
        sd = sd_speedup(inputs.e_sd, inputs.k, r) if inputs.e_sd else None
        ssd = None
        if inputs.p_hit is not None and inputs.e_hit is not None and e_miss is not None:
            full_depth = (inputs.k + 1) * r <= 1.0 and inputs.e_sd is not None
            e_hit = max(inputs.e_hit, inputs.e_sd) if full_depth else inputs.e_hit
            ssd = ssd_speedup(inputs.p_hit, e_hit, e_miss, inputs.k, r, inputs.backup_forwards)
        elif inputs.p_hit == 0.0 and e_miss is not None:  # never hit: E_hit is irrelevant
            ssd = ssd_speedup(0.0, 0.0, e_miss, inputs.k, r, inputs.backup_forwards)
        rows.append(
            {
                "ratio": r,
                "sd_speedup": sd,
                "ssd_speedup": ssd,
                "measured": r == inputs.measured_ratio,
            }
        )
    return {
        "label": "projection (not measured): SSD speedup formula of docs/architecture.md §1, T_p = (K+1) draft forwards, "
        "verify = 1 target forward, SD round = K draft forwards + 1 verify",
        "inputs": asdict(inputs),
        "rows": rows,
    }
