"""Prompts of waiting requests read between rounds, so a join does not stall running rows.

Serving, a request that may join the running batch but whose prompt has more unread
tokens than one chunk is not seated at once (its whole prompt would be read at the
re-seat while every running row waits). Instead, at each round boundary, `ReadAhead`
reads one chunk of it into the target's prefix store (`Runner.read_ahead`), taking about
as long as the round just run took (READ_SHARE), so running rows keep at least about half
of the time; once the rest fits one chunk the request is seated and takes its prompt
from the store like any prefix-cache hit. A read that fails (out of memory, say) costs
only the reading ahead: the request is read whole at its seat. A drafter with a model of its own reads the
same chunk into its store (Drafter.read_ahead; SSD's worker after its pre-speculation). A runner that cannot read ahead, or a store
that cannot hold the prompt, seats the request as before. Whether its prefix was cached
before is still reported as such: tokens read ahead are not counted as cache hits.
"""

from __future__ import annotations

import logging
import time
import torch

from ssdlocal.core.errors import SSDLocalError
from ssdlocal.core.sequence import Request
from ssdlocal.draft.base import Drafter

log = logging.getLogger(__name__)
# what a failed read ahead may raise (out of memory, a llama.cpp decode error): the request
# is then read whole at its seat, and the running rows never see the failure
READ_FAILURES = (SSDLocalError, torch.OutOfMemoryError, RuntimeError)

READ_SHARE = 1.0  # reading ahead takes about this share of the last round's time per boundary
BLOCK = 16  # chunks are whole multiples of this (the torch store keeps whole 16-token blocks)
FIRST_CHUNK = 2 * BLOCK  # before a rate is measured
MAX_CHUNK = 512


class ReadAhead:
    """Reading-ahead state of one serving loop: per request, what the store held before
    (`cached_before`), and the measured reading rate."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.rate: float | None = None  # tokens per second of the last chunk
        self._before: dict[int, int] = {}  # request id -> tokens the store held at its first look
        self._stalled: set[int] = set()  # requests the store could not take further
        self._read: set[int] = set()  # requests some of whose prompt was read ahead

    def chunk(self, round_s: float) -> int:
        """Tokens to read at one boundary after a round of `round_s` seconds."""
        if self.rate is None:
            return FIRST_CHUNK
        n = int(self.rate * round_s * READ_SHARE) // BLOCK * BLOCK
        return max(BLOCK, min(MAX_CHUNK, n))

    def _held(self, request: Request) -> int:
        held = self.runner.read_ahead(request.prompt[:-1], 0)
        self._before.setdefault(request.id, held)
        return held

    def ready(self, request: Request, chunk: int) -> bool:
        """Seat it now: what its prompt lacks in the store fits one chunk (or no more can be read ahead)."""
        if request.id in self._stalled:
            return True
        return len(request.prompt) - 1 - self._held(request) <= chunk

    def read(self, request: Request, chunk: int, drafter: Drafter | None = None) -> None:
        """One chunk of `request`'s prompt (one that is not `ready`) into the target's store
        and, when it reads ahead too (Drafter.read_ahead), the drafter's, as far as the
        target's went."""
        held, t0 = self._held(request), time.perf_counter()
        try:
            now = self.runner.read_ahead(request.prompt[:-1], chunk)
        except READ_FAILURES as exc:
            log.warning("reading a waiting prompt ahead failed (it is read at its seat): %s", exc)
            self._stalled.add(request.id)
            return
        self._read.add(request.id)
        if now <= held:
            self._stalled.add(request.id)  # the store cannot hold more of it: read it whole at its seat
        else:
            self.rate = (now - held) / max(time.perf_counter() - t0, 1e-6)
        if drafter is not None:  # a drafter without a model of its own reads nothing (DrafterBase)
            try:
                drafter.read_ahead(request.prompt[:now], chunk)
            except READ_FAILURES as exc:  # the draft reads the rest at the seat
                log.warning("the draft could not read a waiting prompt ahead: %s", exc)

    def cached_before(self, request: Request) -> int | None:
        """Tokens of its prompt the store held before any was read ahead (None: none was)."""
        return self._before.get(request.id) if request.id in self._read else None

    def forget(self, ids) -> None:
        """Requests seated or cancelled."""
        for rid in ids:
            self._before.pop(rid, None)
            self._stalled.discard(rid)
            self._read.discard(rid)
