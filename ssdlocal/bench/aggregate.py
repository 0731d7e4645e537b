"""Per-system aggregates over benchmark records (pure), with the shared metric names.

Rates are ratios of sums (total tokens / total decode time, accepted / drafted, ...);
`tokens_per_s_mean` is the plain mean of the per-record rates. Speedups compare
`tokens_per_s` (the total rate); a system that failed the exactness check gets none.
"""

from __future__ import annotations

from statistics import mean

from ssdlocal.speculation.projection import ProjectionInputs
from ssdlocal.core.metrics import Counts, Metrics


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def aggregate(records: list[dict], system: str) -> dict:
    """Totals and rates of one system's records: speculation counts summed, then the same
    Metrics as a single call's."""
    recs = [r for r in records if r["system"] == system]
    decode_tokens = sum(r["decode_tokens"] for r in recs)
    decode_s = sum(r["decode_s"] for r in recs)
    rates = [r["tokens_per_s"] for r in recs if r["tokens_per_s"] is not None]
    ttfts = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
    out: dict = {
        "records": len(recs),
        "tokens": sum(r["tokens"] for r in recs),
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "tokens_per_s": _ratio(decode_tokens, decode_s),
        "tokens_per_s_mean": mean(rates) if rates else None,
        "ttft_s": mean(ttfts) if ttfts else None,
    }
    specs = [r["spec"] for r in recs if r.get("spec")]
    if not specs:
        return out
    total = sum((Counts.from_dict(sp) for sp in specs), Counts(k=specs[0]["k"]))
    m = Metrics.of(total)
    out.update(
        k=total.k,
        rounds=total.rounds,
        draft_ms_per_round=m.draft_ms_per_round,
        verify_ms_per_round=m.verify_ms_per_round,
    )
    if total.k == 0:
        return out
    out.update(
        acceptance_rate=m.acceptance_rate,
        mean_accepted_len=m.mean_accepted_len,
        accepted_len_hist=list(m.accepted_len_hist),
        drafted=total.drafted,
        accepted=total.accepted,
    )
    if m.ssd is not None:
        out.update(m.ssd.to_dict())  # the SSD part under core.metrics' names
        out.update(draft_busy_ms_per_round=_ratio(m.ssd.draft_busy_ms, total.rounds))
    return out


def aggregate_all(records: list[dict], systems: list[str], exactness: dict[str, dict]) -> dict[str, dict]:
    """Aggregates for every system, with exactness status and speedups vs AR and SD."""
    aggs = {s: aggregate(records, s) for s in systems}
    for s, agg in aggs.items():
        agg["exactness"] = (exactness.get(s) or {}).get("status", "n/a")
        agg["valid"] = agg["exactness"] != "FAIL"
    for s, agg in aggs.items():
        for ref in ("ar", "sd"):
            base = aggs.get(ref)
            ok = agg["valid"] and base is not None and base["valid"]
            rate, base_rate = agg["tokens_per_s"], base["tokens_per_s"] if base else None
            agg[f"speedup_vs_{ref}"] = rate / base_rate if ok and rate and base_rate else None
    return aggs


def projection_inputs(aggs: dict[str, dict], k: int) -> ProjectionInputs:
    """Measured inputs for project.py: E_SD, p_hit, E_hit, E_miss from SD / SSD, the
    draft/target forward ratio from SD's draft time per round / K over AR's time per step,
    and the draft forwards one SSD miss costs (K for each jit backup, 0 for n-gram / none)."""
    sd, ssd, ar = aggs.get("sd") or {}, aggs.get("ssd") or {}, aggs.get("ar") or {}
    ratio = None
    if sd.get("draft_ms_per_round") and ar.get("verify_ms_per_round"):
        ratio = sd["draft_ms_per_round"] / k / ar["verify_ms_per_round"]
    backups = ssd.get("backup_used") or {}
    n_backup = sum(backups.values())
    backup_forwards = k * backups.get("jit", 0) / n_backup if n_backup else float(k)
    return ProjectionInputs(
        k=k,
        e_sd=sd.get("mean_accepted_len"),
        p_hit=ssd.get("cache_hit_rate"),
        e_hit=ssd.get("tokens_per_round_hit"),
        e_miss=ssd.get("tokens_per_round_miss"),
        backup_forwards=backup_forwards,
        measured_ratio=ratio,
    )


def session_turns(records: list[dict], systems: list[str]) -> list[dict]:
    """Per system and turn of the session workload: mean time to first token, end-to-end
    seconds (first token + decode), prompt and reused tokens, and the speed at which the
    rest of the prompt was read (turn 1 starts cold, so its rate is the cold prefill's)."""
    rows = []
    for system in systems:
        turns: dict[int, list[dict]] = {}
        for r in records:
            if r["system"] == system and r.get("session") is not None and r["ttft_s"] is not None:
                turns.setdefault(r["turn"], []).append(r)
        for turn, recs in sorted(turns.items()):
            rates = [r["prefill_tokens_per_s"] for r in recs if r.get("prefill_tokens_per_s")]
            rows.append(
                {
                    "system": system,
                    "turn": turn,
                    "records": len(recs),
                    "ttft_s": mean(r["ttft_s"] for r in recs),
                    "e2e_s": mean(r["ttft_s"] + r["decode_s"] for r in recs),
                    "prompt_tokens": mean(r.get("prompt_tokens") or 0 for r in recs),
                    "cached_tokens": mean(r.get("cached_tokens") or 0 for r in recs),
                    "prefill_tokens_per_s": mean(rates) if rates else None,
                }
            )
    return rows
