"""Per-row sampling and the inbox a serving loop reads.

The engine's loop (engine/batch.py) seats requests (core.sequence.Request) as rows of a
running batch; `Inbox` is how another thread hands it new requests and cancels running
ones, between rounds. `RowSampling` verifies a batch whose rows sample differently: rows
with equal sampling settings (temperature, top-k, top-p) verify together, each such group
with its own generator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sequence import Request
from ssdlocal.core.verify import Verdict, verify_groups


class RowSampling:
    """Per-row sampling of one batch: `verify` runs core.verify.verify_logits once per
    group of rows with equal Request.settings, each group drawing from its own generator.

    `generators` (settings -> torch.Generator) is kept across batches by the caller, so a
    group's random stream goes on when rows join or leave; a new group's generator is
    seeded with the seed of its first row. One group (every generate call) runs exactly
    what a single verify_logits call with that row's params runs."""

    def __init__(self, requests: Sequence[Request], device, generators: dict | None = None) -> None:
        self.generators = generators if generators is not None else {}
        self.row_params = tuple(r.params for r in requests)  # what a drafter draws each row with
        groups: dict[tuple, list[int]] = {}
        for b, req in enumerate(requests):
            groups.setdefault(req.settings, []).append(b)
        self.groups = []
        for key, rows in groups.items():
            params = requests[rows[0]].params
            if key not in self.generators:
                self.generators[key] = torch.Generator(device=device).manual_seed(params.seed)
            index = None if len(groups) == 1 else torch.tensor(rows, dtype=torch.long, device=device)  # [G]
            self.groups.append((index, params, self.generators[key]))
        for key in [k for k in self.generators if k not in groups]:
            del self.generators[key]  # nobody seated samples with these settings any more

    @property
    def params(self) -> SamplingParams:
        """The first group's params (what a drafter that draws one way uses)."""
        return self.groups[0][1]

    def verify(self, logits: torch.Tensor, drafts: torch.Tensor, q, n_draft=None) -> Verdict:
        """core.verify.verify_groups over this batch's groups."""
        return verify_groups(logits, drafts, q, self.groups, n_draft)


class Inbox:
    """New requests and cancels for a serving loop, from any thread (Engine.serve reads it
    between rounds). Requests join in arrival order (the first that may not join, a seeded
    sample's `exclusive` key, holds the ones behind it)."""

    def __init__(self, gather_s: float = 0.0) -> None:
        self.gather_s = gather_s  # an idle loop waits this long after a first arrival: requests sent together
        self._cond = threading.Condition()
        self._waiting: list[Request] = []
        self._cancelled: set[int] = set()
        self._closed = False

    def add(self, *requests: Request) -> None:
        """Requests in line, after every request added before (together: one after another)."""
        with self._cond:
            self._waiting.extend(requests)
            self._cond.notify_all()

    def cancel(self, request_id: int) -> None:
        """Drop the request if it waits; a seated one finishes "cancelled" at the next boundary."""
        with self._cond:
            self._cancelled.add(request_id)
            self._waiting = [r for r in self._waiting if r.id != request_id]
            self._cond.notify_all()

    def close(self) -> None:
        """No more requests: the loop ends once its rows are done."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def take_cancels(self) -> set[int]:
        with self._cond:
            taken, self._cancelled = self._cancelled, set()
        return taken

    def _joinable(self, room: int, seated: Sequence[Request]) -> list[Request]:
        out: list[Request] = []
        for req in self._waiting:
            if len(out) >= room or not _may_share(req, [*seated, *out]):
                break
            out.append(req)
        return out

    def joinable(self, room: int, seated: Sequence[Request]) -> list[Request]:
        """The waiting requests that may join now (they stay waiting)."""
        with self._cond:
            return self._joinable(room, seated)

    def take(
        self, room: int, seated: Sequence[Request], ready: Callable[[Request], bool] | None = None
    ) -> list[Request]:
        """Up to `room` waiting requests that may join `seated`, in arrival order; with
        `ready`, only those it accepts (the others keep their place in line)."""
        with self._cond:
            out = self._joinable(room, seated)
            if ready is not None:
                out = [r for r in out if ready(r)]
            taken = {r.id for r in out}
            self._waiting = [r for r in self._waiting if r.id not in taken]
            return out

    def wait(self, timeout: float | None = None) -> None:
        """Block until a request arrives, a cancel, or close (or `timeout` seconds); after
        an arrival, `gather_s` more (requests sent together arrive a few ms apart)."""
        with self._cond:
            if not self._waiting and not self._closed:
                self._cond.wait(timeout)
                if self._waiting and self.gather_s > 0:
                    self._cond.wait(self.gather_s)


def _may_share(request: Request, seated: Sequence[Request]) -> bool:
    """Rows with an `exclusive` key share a batch only with rows of the same key."""
    return all(r.exclusive == request.exclusive for r in seated)
