"""Exactness at temperature 0: every system's tokens vs AR's, with the target's logit
margin at the first divergence, so a bf16 near-tie can be told from a bug (docs/architecture.md §2).

`logit_margin` runs the engine's loaded target (its Runner) on prompt + common
prefix; it resets the runner's cache, so call it only between generations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ssdlocal.backends.base import Logits

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MarginFn = Callable[[Sequence[int], Sequence[int], Sequence[int]], dict]


def divergence_index(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First index where two token lists differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def logit_margin(runner, prompt: Sequence[int], prefix: Sequence[int], tokens: Sequence[int] = (), dtype=None) -> dict:
    """Target logits after prompt + prefix: top1 - top2 margin, the top-2 ids, the logit of
    each id in `tokens` (e.g. AR's token and the other system's token there), and
    `near_tie`: the margin is within 2 units in the last place of the model's `dtype` at
    the top logit's magnitude (kernel-shape rounding can swap such a pair)."""
    ids = list(prompt) + list(prefix)
    runner.reset(1, len(ids) + 2)
    logits = runner.feed([ids], Logits.LAST)[0][-1].float()  # [V]
    top = torch.topk(logits, 2)
    margin = float(top.values[0] - top.values[1])
    top1 = abs(float(top.values[0])) or 1.0
    ulp = 2.0 ** (math.floor(math.log2(top1)) - MANTISSA_BITS.get(dtype, 23))
    return {
        "margin": margin,
        "near_tie": margin <= 2 * ulp,
        "top1_id": int(top.indices[0]),
        "top2_id": int(top.indices[1]),
        "token_logits": {str(t): float(logits[t]) for t in tokens if 0 <= t < logits.numel()},
    }


def check_exactness(
    records: list[dict],
    prompt_ids: dict[str, list[int]],
    margin_fn: MarginFn | None,
    reference: str = "ar",
) -> dict[str, dict]:
    """Compare each record's rows with the reference system's rows for the same prompts.

    records: dicts with "system", "prompt_ids" (ids of the prompts in the batch) and
    "token_ids" (per row). Sets record["exact"] (bool) and record["divergences"], and
    returns per system {"status": "exact" | "FAIL", "rows", "mismatched_rows",
    "divergences"}; the reference system itself is "reference".
    """
    ref: dict[str, list[int]] = {}
    for rec in records:
        if rec["system"] == reference:
            for pid, toks in zip(rec["prompt_ids"], rec["token_ids"]):
                ref.setdefault(pid, toks)
    margins: dict[tuple, dict] = {}
    out: dict[str, dict] = {}
    for rec in records:
        system = rec["system"]
        summary = out.setdefault(system, {"status": "exact", "rows": 0, "mismatched_rows": 0, "divergences": []})
        if system == reference:
            summary["status"] = "reference"
            rec["exact"] = True
            continue
        rec["divergences"] = []
        for pid, toks in zip(rec["prompt_ids"], rec["token_ids"]):
            summary["rows"] += 1
            expected = ref.get(pid)
            idx = None if expected is None else divergence_index(expected, toks)
            if idx is None:
                continue
            want = expected[idx] if idx < len(expected) else None
            got = toks[idx] if idx < len(toks) else None
            div = {"prompt_id": pid, "index": idx, "ar_token": want, "token": got}
            if margin_fn is not None:
                key = (pid, tuple(expected[:idx]))
                if key not in margins:
                    margins[key] = margin_fn(prompt_ids[pid], expected[:idx], [t for t in (want, got) if t is not None])
                div.update(margins[key])
            rec["divergences"].append(div)
            summary["mismatched_rows"] += 1
            summary["status"] = "FAIL"
            if len(summary["divergences"]) < 10:
                summary["divergences"].append(div)
        rec["exact"] = not rec["divergences"]
    return out
