"""How many weights one forward step reads, as arithmetic: a dense model reads every weight
whatever the number of tokens; a mixture-of-experts model reads, in each layer, only the
routed experts its tokens chose, so a step of several tokens (a K+1-token verification)
reads more of them than a step of one. Sizes come from weights/size.py (files) or a pair
manifest (weights/pairs.py); what a step costs in time is bytes over bandwidth where a step
is memory-bound. No torch, no files.
"""

from __future__ import annotations


def experts_touched(routed: int, used: int, tokens: int) -> float:
    """Expected share of a layer's `routed` experts a step of `tokens` tokens reads when each
    token picks `used` of them, uniformly and independently: 1 - (1 - used/routed)^tokens
    (used/routed for one token). Real routers favour some experts, so a real step reads
    this many or fewer."""
    if not 0 < used <= routed or tokens < 1:
        raise ValueError(f"experts_touched({routed}, {used}, {tokens})")
    return 1.0 - (1.0 - used / routed) ** tokens


def step_params(total: float, active: float, routed: int | None, used: int | None, tokens: int = 1) -> float:
    """Parameters a step of `tokens` tokens reads, for a model of `total` parameters of which
    one token reads `active` (equal for a dense model, or without `routed`/`used`): those
    every token reads, plus the routed experts' expected share (experts_touched)."""
    if not routed or not used or active >= total:
        return total
    experts = (total - active) / (1.0 - used / routed)  # all routed experts' weights
    return total - experts + experts * experts_touched(routed, used, tokens)
