"""SD with a block drafter (DFlash): one forward of the drafter gives a whole block of drafts.

The drafter reads some of the target's layer outputs (its `hidden` layers). The engine hands
them over at the seating's start (every prompt position the target read) and after every
round (the positions the round scored); the drafter turns those of the verified positions
(the pending token and the accepted drafts) into its context keys and values. Each round
one forward over [the row's newest token, mask x (block_size - 1)] gives block_size - 1
distributions at once; the first K are drawn, each from its own distribution alone
(draft.decode.DraftDecoder.draw_block).

Why independent draws verify losslessly: speculative sampling needs each draft d_j to be
drawn from a distribution q_j that may depend on the verified prefix and on d_1..d_{j-1},
and the target to accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), resampling from
norm(max(p_j - q_j, 0)) at the first rejection. A q_j that ignores d_1..d_{j-1} is such a
distribution (its conditional given the earlier drafts is itself, since the draws are
independent), so verification with the q_j the drafts were drawn from keeps the target's
distribution exactly; only acceptance depends on how good the drafter is. SD only, like
every head (docs/architecture.md, "Draft heads").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.draft.base import DraftResources, PromptHidden, Proposal, RoundOutcome, RowView
from ssdlocal.backends.base import HiddenLayers
from ssdlocal.draft.beside import BesideDrafter
from ssdlocal.draft.decode import Drafting


class BlockDrafter(BesideDrafter):
    """Drafter protocol over a block drafter beside the target (backends/torch/heads/dflash_runner.py)."""

    last: torch.Tensor | None = None  # [B]: each row's newest token (its block's first)

    @staticmethod
    def layers_read(runner) -> HiddenLayers:
        return runner.hidden_layers

    def start(self, rows: Sequence[RowView], hidden: PromptHidden | None = None) -> None:
        """The context of the read prompt positions: column j of row b is position start[b] + j."""
        assert hidden is not None  # the engine hands it to a drafter with `hidden`
        self.rows = rows
        self.runner.reset(len(rows), self.num_slots)
        self._context(hidden.states, list(hidden.start), list(hidden.fed), opening=True)

    def _context(self, states: torch.Tensor, starts: list[int], counts: list[int], opening: bool = False) -> None:
        """The states of positions starts[b] .. + counts[b] - 1 (column j: start + j) -> the
        drafter's context; each row's newest token -> `last`. One staged upload."""
        width = max(counts)
        host = [[s, n, row.tail(row.length - 1)[0]] for s, n, row in zip(starts, counts, self.rows)]
        staged = self.site.upload(host, self.runner.device)  # [B, 3]: start, count, newest token
        self.runner.add_context(states[:, :width], staged[:, 0], staged[:, 1], opening)
        self.last = staged[:, 2]

    def propose(self, active: Sequence[bool]) -> Proposal:
        """K drafts per row from one block forward: position j's distribution gives d_j."""
        assert self.last is not None
        bound = max(row.length for row in self.rows) + self.runner.block_size
        block = self.runner.draft(self.last, bound)[:, : self.k]  # [B, K, V]
        drafted = self.decoder.draw_block(block)
        return self._proposal(drafted, active)

    def observe(self, outcome: RoundOutcome) -> None:
        """The round's verified positions become context: the states the target computed
        for the pending token and the accepted drafts (one per token the row took)."""
        assert outcome.hidden is not None
        taken = [len(t) for t in outcome.appended]
        if not any(taken):
            return
        starts = [row.length - n - 1 for row, n in zip(self.rows, taken)]  # the pending token's position
        self._context(outcome.hidden, starts, taken)


def build_block(spec, params: SamplingParams, res: DraftResources) -> BlockDrafter:
    """The drafter of a HeadDraft of kind "dflash": the drafter loaded beside the target, on
    its device, sharing its embeddings and lm_head (Runner.head_inputs). K is at most the
    block's drafts (block_size - 1)."""
    from ssdlocal.backends.registry import load_head
    from ssdlocal.core.errors import UsageError

    if res.target is None:
        raise RuntimeError("a block drafter needs the target's runner")  # a caller bug
    shared = res.target.head_inputs()
    runner = load_head(spec.draft.head, spec.draft.path, shared, res.target_vocab, res.target_device)
    most = runner.block_size - 1
    if spec.k > most:
        raise UsageError(
            f"this DFlash drafter (block size {runner.block_size}) drafts at most {most} tokens a round, not {spec.k}",
            f"use --k {most} or less (or leave --k out: K is then {most})",
        )
    drafter = BlockDrafter(
        Drafting(runner, spec.k, params, res.target_vocab, res.row_params), res.target_device, res.audit
    )
    drafter.reserve(res.batch, res.num_slots)
    return drafter
