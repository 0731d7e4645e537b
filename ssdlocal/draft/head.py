"""SD with a draft head (an EAGLE-3 checkpoint or Gemma 4's MTP assistant) that drafts from
the target's hidden states.

The head reads some of the target's hidden states (its `hidden` layers: three layer outputs
for EAGLE-3, the final one for the assistant); the engine hands them over at the seating's
start (every prompt position the target read: an EAGLE-3 head's own cache fills with them)
and after every round (the positions the round scored). Each round the head first catches
up on the pairs the target verified (the state after token q with token q + 1: the pending
token and the accepted drafts, the bonus last), which gives draft 1, then drafts d_2..d_K
from its own states (draft.decode.DraftDecoder).
Drafts are verified like any draft: the head changes speed, never the output. SSD has no
head drafter: a head needs the hidden state of the token it continues, which exists only
once the target has verified it (docs/architecture.md, "Draft heads").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.draft.base import DrafterBase, DraftResources, PromptHidden, Proposal, RoundOutcome, RowView
from ssdlocal.backends.base import HiddenLayers
from ssdlocal.draft.beside import BesideDrafter
from ssdlocal.draft.decode import Drafting


class HeadDrafter(BesideDrafter):
    """Drafter protocol over a draft head beside the target (backends/torch/heads)."""

    first: torch.Tensor | None = None  # [B, V]: the head's logits for each row's next draft

    @staticmethod
    def layers_read(runner) -> HiddenLayers:
        return runner.head.args.hidden_layers

    def start(self, rows: Sequence[RowView], hidden: PromptHidden | None = None) -> None:
        """Fill the head's cache with the read prompt positions: column j of row b pairs the
        target's state at position start[b] + j with the token after it."""
        assert hidden is not None  # the engine hands it to a drafter with `hidden`
        self.rows = rows
        self.runner.reset(len(rows), self.num_slots)
        pairs = [row.tail(s + 1)[:n] for row, s, n in zip(rows, hidden.start, hidden.fed)]
        width = hidden.states.shape[1]
        self.first = self._catch_up(pairs, hidden.states[:, :width], list(hidden.start))

    def _catch_up(self, tokens: list[list[int]], states: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """The pairs (state of column j, tokens[b][j]) at positions starts[b] + j -> the logits
        after each row's last pair [B, V]: one staged upload, one head forward."""
        width = states.shape[1]
        host = [[s, len(t)] + list(t) + [0] * (width - len(t)) for s, t in zip(starts, tokens)]
        staged = self.site.upload(host, self.runner.device)  # [B, 2 + T]: start, count, ids
        bound = max(s + len(t) for s, t in zip(starts, tokens)) + 1
        return self.runner.catch_up(staged[:, 2:], states, staged[:, 1], staged[:, 0], bound)

    def propose(self, active: Sequence[bool]) -> Proposal:
        """K drafts per row: d_1 from the last catch-up, then the head's own steps."""
        assert self.first is not None
        bound = max(row.length for row in self.rows) + self.k + 1
        drafted = self.decoder.decode(self.first, min(bound, self.num_slots))
        return self._proposal(drafted, active)

    def observe(self, outcome: RoundOutcome) -> None:
        """Catch up on what the round verified: the states of the positions it scored (the
        pending token and the accepted drafts) with the tokens the rows took after them."""
        assert outcome.hidden is not None
        taken = [list(t) for t in outcome.appended]
        starts = [row.length - len(t) - 1 if t else 0 for row, t in zip(self.rows, taken)]  # the pending token's
        if not any(taken):
            return
        width = max(map(len, taken))
        self.first = self._catch_up(taken, outcome.hidden[:, :width], starts)


def build_head(spec, params: SamplingParams, res: DraftResources) -> DrafterBase:
    """The drafter of a HeadDraft (its row in draft.factory.BUILDERS): the head of its kind
    loaded beside the target, on its device, sharing its embeddings (Runner.head_inputs)."""
    from ssdlocal.backends.registry import load_head
    from ssdlocal.core.config import Mode
    from ssdlocal.core.errors import UsageError

    if spec.mode is not Mode.SD:
        raise UsageError(
            f"a draft head drafts in SD only, not {spec.mode.value}",
            "use --mode sd (or auto) with a head, or a draft model for SSD",
        )
    if spec.draft.head == "dflash":  # a block drafter: its own Drafter (draft/block.py)
        from ssdlocal.draft.block import build_block

        return build_block(spec, params, res)
    if res.target is None:
        raise RuntimeError("a draft head needs the target's runner")  # a caller bug
    shared = res.target.head_inputs()
    runner = load_head(spec.draft.head, spec.draft.path, shared, res.target_vocab, res.target_device)
    drafter = HeadDrafter(
        Drafting(runner, spec.k, params, res.target_vocab, res.row_params), res.target_device, res.audit
    )
    drafter.reserve(res.batch, res.num_slots)
    return drafter
