"""Bookkeeping shared by every runner: which of a row's tokens may stay cached.

Runners keep `held[b]`, the tokens of row b whose keys/values are in the cache. After a
commit only a prefix of them is still valid; `sync_held` computes it. Pure list code.
"""

from __future__ import annotations

from collections.abc import Sequence


def sync_held(held: list[int], committed: Sequence[int]) -> None:
    """Shorten `held` in place to what may stay cached before the next feed.

    That is the longest common prefix with `committed`, but never `committed`'s last
    token: its logits predict the next token, so the next feed must start with it. (It
    can already be cached when the bonus token equals the draft token rejected at that
    position, e.g. by verify's RESIDUAL_EPS fallback.)
    """
    n = max(0, min(len(held), len(committed) - 1))
    if held[:n] == list(committed[:n]):  # common case, C-speed comparison
        del held[n:]
        return
    keep = 0
    while held[keep] == committed[keep]:
        keep += 1
    del held[keep:]
