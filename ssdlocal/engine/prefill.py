"""Reading a call's prompts into the target, and keeping what its caches hold afterwards.

A row starts from the longest prefix of its prompt that the target's prefix cache holds
(backends: `Runner.reuse`) and feeds only the rest, in chunks that a cancel can stop; the
first token comes from the last prompt position. When a call ends normally, each row's
tokens that the target's cache holds (and the drafter's) go to the prefix caches for later
calls. Knows nothing about rounds or speculation.
"""

from __future__ import annotations

import logging
import time

import torch

from ssdlocal.backends.base import Logits
from ssdlocal.core.events import PrefillEvent, PrefillProgress
from ssdlocal.core.memory import oom_error
from ssdlocal.engine.shape import Shaper

log = logging.getLogger(__name__)


class PrefillStopped(Exception):
    """The call was cancelled while its prompts were being read."""


def read_prompts(runner, guard, rows, params, generator, token, progress,
                 shaper=None) -> tuple[torch.Tensor, PrefillEvent]:  # fmt: skip
    """Feed every row's prompt; the first token of each row ([B] on the target's device),
    appended to the rows. PrefillStopped when `token` is cancelled while a long prompt is
    read (within one chunk); `progress(PrefillProgress)` as chunks finish. `shaper`
    (engine.shape.Shaper): the call's grammar masks and log-probabilities for that token."""
    t0 = time.perf_counter()
    reused = [runner.reuse(b, r.prompt[:-1]) for b, r in enumerate(rows)]  # the last is fed: its logits
    pending = [runner.pending(b, r.prompt) for b, r in enumerate(rows)]
    longest = max(range(len(rows)), key=lambda b: len(pending[b]))

    def report(done: int, total: int) -> None:
        if token.cancelled:
            raise PrefillStopped
        if progress is not None:
            progress(PrefillProgress(reused[longest] + done, len(rows[longest].prompt)))

    logits = guard(runner.feed, pending, Logits.LAST, report)
    last = torch.stack([lg[-1] for lg in logits])[:, None]  # [B, 1, V]
    shaper = shaper if shaper is not None else Shaper()
    first, host = shaper.first_token(last, params, generator)  # [B] (grammar-masked, logprobs kept), read once
    for row, token_id in zip(rows, host):
        row.append(token_id)
    runner.begin_steps()
    prompts = tuple(len(r.prompt) for r in rows)
    return first, PrefillEvent(time.perf_counter() - t0, len(rows), prompts, tuple(reused))


def store_prefixes(runner, rows, cached: list[int], drafter) -> None:
    """After a call: each row's first `cached` tokens (what the target's cache holds) and
    what the drafter's model holds go to the prefix caches. A failure to store costs later
    calls their reuse, never this call its answer."""
    try:
        for b, (row, n) in enumerate(zip(rows, cached)):
            runner.store(b, row.tokens[: min(n, row.length)])
        if drafter is not None:
            drafter.store_prefixes()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if oom_error(exc) is None:
            raise
        log.warning("the prefix cache was not updated: out of memory while copying (%s)", exc)
