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
from collections.abc import Callable

import torch

from ssdlocal.backends.base import Logits
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.events import PrefillEvent, PrefillProgress
from ssdlocal.core.memory import oom_error
from ssdlocal.engine.seating import Seating

log = logging.getLogger(__name__)


class PrefillStopped(Exception):
    """The call was cancelled while its prompts were being read."""


def read_prompts(
    seating: Seating, token: CancelToken, progress: Callable[[PrefillProgress], None] | None = None
) -> tuple[torch.Tensor, PrefillEvent]:
    """Feed every row's prompt; the first token of each row ([B] on the target's device),
    appended to the rows. PrefillStopped when `token` is cancelled while a long prompt is
    read (within one chunk); `progress(PrefillProgress)` as chunks finish. The seating's
    `sampling` draws the first tokens, its `shaper` masks them by grammar and reads their
    log-probabilities; a drafter that reads hidden states gets the prompt's last ones.

    A row that is not `fresh` carries on from an earlier seating (a re-seat). It takes
    the longest prefix of its tokens the prefix cache holds and feeds the rest but its
    newest token, which stays pending (the first thing the next round feeds): nothing is
    drawn for it. Its PrefillEvent entries are 0 (no prompt was read)."""
    t0 = time.perf_counter()
    runner, rows, fresh, shaper = seating.target, seating.rows, seating.fresh, seating.shaper
    # what each row must hold before its pending token: a fresh row's prompt but the last
    # (fed: its logits), a carried row's tokens but the newest, at least one of them fed
    reads = [r.prompt if new else r.tokens[:-1] for r, new in zip(rows, fresh)]
    reused = [runner.reuse(b, seq[:-1]) for b, seq in enumerate(reads)]
    pending = [runner.pending(b, seq) for b, seq in enumerate(reads)]
    longest = max(range(len(rows)), key=lambda b: len(pending[b]))

    def report(done: int, total: int) -> None:
        if token.cancelled:
            raise PrefillStopped
        if progress is not None:
            progress(PrefillProgress(reused[longest] + done, len(reads[longest])))

    logits = seating.guard(runner.feed, pending, Logits.LAST, report)
    seating.read = (tuple(runner.cached(b) - len(p) for b, p in enumerate(pending)), tuple(map(len, pending)))
    last = torch.stack([lg[-1] for lg in logits])[:, None]  # [B, 1, V]
    first, host = shaper.first_token(last, seating.sampling, fresh)  # [B] (grammar-masked, logprobs kept), read once
    for row, token_id, new in zip(rows, host, fresh):
        if new:
            row.append(token_id)
    if not all(fresh):  # carried rows' pending token is their newest, not a new draw
        first = shaper.site.upload([r.tokens[-1] for r in rows], first.device)  # [B]
    runner.begin_steps()
    prompts = tuple(len(r.prompt) if new else 0 for r, new in zip(rows, fresh))
    cached = tuple(n if new else 0 for n, new in zip(reused, fresh))
    return first, PrefillEvent(time.perf_counter() - t0, len(rows), prompts, cached)


def store_prefixes(seating: Seating) -> None:
    """After a seating: each row's tokens the target's cache holds (`Runner.cached`) and what
    the drafter's model holds go to the prefix caches. A failure to store costs later
    calls their reuse, never this call its answer."""
    runner = seating.target
    try:
        for b, row in enumerate(seating.rows):
            runner.store(b, row.tokens[: min(runner.cached(b), row.length)])
        if seating.drafter is not None:
            seating.drafter.store_prefixes()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if oom_error(exc) is None:
            raise
        log.warning("the prefix cache was not updated: out of memory while copying (%s)", exc)
