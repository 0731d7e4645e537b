"""Synchronous drafters: the n-gram (prompt-lookup) proposer and a draft model in-process.

Both run on the target's thread between verifications (SD). The SSD worker has its
own drafting code (draft/ssd/speculator.py), which also decodes fan-out trees; its
just-in-time backup uses the same K-step decoder (draft/decode.py) as ModelDrafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.models import NgramDraft
from ssdlocal.draft.base import Proposal, RoundOutcome, RowView
from ssdlocal.draft.decode import DraftDecoder
from ssdlocal.speculation.ngram import propose_ngram


class NgramDrafter:
    """Prompt-lookup proposals; deterministic, so verified as point masses (q=None)."""

    def __init__(self, k: int, draft: NgramDraft = NgramDraft(), device="cpu") -> None:
        self.k = k
        self.draft = draft
        self.device = device  # where the target verifies
        self.rows: Sequence[RowView] = ()

    def start(self, rows: Sequence[RowView]) -> None:
        self.rows = rows

    def propose(self, active: Sequence[bool]) -> Proposal:
        tokens = [
            propose_ngram(row.tokens, self.k, self.draft.n_max, self.draft.n_min) if on else []
            for row, on in zip(self.rows, active)
        ]
        return Proposal.from_lists(tokens, self.k, self.device)

    def observe(self, outcome: RoundOutcome) -> None:
        return None

    def close(self) -> None:
        return None


class ModelDrafter:
    """A draft model run just in time: K forwards per round, batched over rows, with the
    draft's tokens, positions and distributions kept on its device (draft/decode.py).

    Cache bookkeeping per row (c = tokens the draft has cached at a round's start, L =
    committed tokens): the first step feeds the 1 or 2 committed tokens it lacks (the
    bonus, preceded by the last draft d_K when all K drafts were accepted), so it is a
    [B, 2] step whose padding writes past L (on a CPU, a [B, 1] step when no row has d_K
    pending); steps 2..K feed d_1..d_{K-1}. After the
    verdict (n accepted) the cache keeps L + min(n, K-1) tokens.
    """

    def __init__(self, runner, k: int, params: SamplingParams, target_vocab: int, device) -> None:
        self.runner = runner  # backends.base.Runner of the draft model
        self.k = k
        self.params = params
        self.target_vocab = target_vocab
        self.device = device  # where the target verifies
        self.decoder = DraftDecoder(runner, k, params, target_vocab, self._generator())
        self.rows: Sequence[RowView] = ()

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.runner.device).manual_seed(self.params.stream_seed(7919))

    def reserve(self, batch_size: int, num_slots: int) -> None:
        """Allocate the draft's KV cache for a batch (engine calls before start)."""
        self.runner.reset(batch_size, num_slots)
        self.decoder.generator = self._generator()

    def start(self, rows: Sequence[RowView]) -> None:
        """Prefill the draft on every row's tokens except its last."""
        self.rows = rows
        sequences = [row.tokens for row in rows]
        self.runner.feed([list(seq[:-1]) for seq in sequences], "none")
        self.runner.begin_steps()
        dev = self.runner.device
        self.last = torch.tensor([seq[-1] for seq in sequences], device=dev)  # [B] pending bonus
        self.last_draft = torch.zeros_like(self.last)  # [B] d_K of the previous round
        self.two = torch.zeros(len(sequences), dtype=torch.long, device=dev)  # [B] 1 if d_K pending

    @torch.inference_mode()
    def propose(self, active: Sequence[bool]) -> Proposal:
        batch, runner = len(active), self.runner
        bound = max(row.length for row in self.rows) + self.k  # past every write of this round
        rows = torch.arange(batch, device=runner.device)  # [B]
        if runner.device.type == "cpu" and not bool(self.two.any()):
            # only the bonus is pending: on a CPU a 1-token step costs less than a 2-token one
            # (no graphs to keep the shape for; reading `two` costs no device sync)
            first = runner.step(self.last[:, None], bound)[:, 0]  # [B, V_d]
        else:
            pair = torch.stack([torch.where(self.two.bool(), self.last_draft, self.last), self.last], 1)
            first = runner.step(pair, bound)[rows, self.two]  # [B, V_d]: after the last pending token
        runner.advance(1 + self.two)
        drafted = self.decoder.decode(first, bound)
        self.last_draft = drafted.tokens[:, -1]
        n_draft = torch.tensor([self.k if a else 0 for a in active], device=self.device)  # [B]
        q = None if drafted.q is None else drafted.q.to(self.device)  # [B, K, V]
        return Proposal(drafted.tokens.to(self.device), n_draft, q)  # [B, K]

    @torch.inference_mode()
    def observe(self, outcome: RoundOutcome) -> None:
        """Keep L + min(n, K-1) cached tokens per active row; finished rows rewind to
        where this round started (so their positions never run past the cache)."""
        dev = self.runner.device
        n, bonus = outcome.verdict.n_accepted.to(dev), outcome.verdict.bonus.to(dev)
        live = torch.tensor(outcome.active, device=dev)  # [B] bool
        fed = self.two + self.k  # [B] tokens fed this round
        keep = 1 + self.two + n.clamp(max=self.k - 1)  # [B] of them still valid
        self.runner.advance(torch.where(live, keep - fed, -fed))
        self.two = (n == self.k).long() & live.long()  # [B]
        self.last = bonus

    def close(self) -> None:
        return None
