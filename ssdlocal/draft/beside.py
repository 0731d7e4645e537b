"""What every drafter beside the target keeps (a draft head, draft/head.py, and a block
drafter, draft/block.py): the backend's runner, the target layers it reads, its decoder on
the runner's device, and the hand-over of its drafts to the target's device. How the
drafts are made (a head's own steps, one block forward) is the subclass's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ssdlocal.backends.base import HiddenLayers
from ssdlocal.core.hostsync import Audit
from ssdlocal.draft.base import DrafterBase, Proposal, RowView
from ssdlocal.draft.decode import DraftDecoder, Drafted, Drafting


class BesideDrafter(DrafterBase):
    """A drafter whose runner (backends.registry.load_head) reads the target's `hidden` layers."""

    def __init__(self, drafting: Drafting, device, audit: Audit | None = None) -> None:
        runner = drafting.runner  # the backend's head or block runner (backends.registry.load_head)
        self.runner: Any = runner
        self.hidden = self.layers_read(runner)
        self.k, self.params, self.device = drafting.k, drafting.params, device
        self.site = (audit or Audit()).site("draft")
        generator = torch.Generator(device=runner.device).manual_seed(self.params.stream_seed(104729))
        self.decoder = DraftDecoder(drafting, generator)
        self.rows: Sequence[RowView] = ()
        self.num_slots = 0

    @staticmethod
    def layers_read(runner) -> HiddenLayers:
        """The target layers the runner's drafter reads (`hidden`)."""
        raise NotImplementedError

    def reserve(self, batch: int, num_slots: int) -> None:
        self.num_slots = num_slots

    def _proposal(self, drafted: Drafted, active: Sequence[bool]) -> Proposal:
        """The drafts (on the runner's device) as a Proposal on the target's device: K a
        row for the active rows, none for the others."""
        n_draft = self.site.upload([self.k if a else 0 for a in active], self.device)  # [B]
        q = None if drafted.q is None else drafted.q.to(self.device, non_blocking=True)
        return Proposal(drafted.tokens.to(self.device, non_blocking=True), n_draft, q)
