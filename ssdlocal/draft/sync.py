"""Synchronous drafters: the n-gram (prompt-lookup) proposer and a draft model in-process.

Both run on the target's thread between verifications (SD). The SSD worker has its
own drafting code (draft/ssd/speculator.py), which also decodes fan-out trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sampling import logits_to_probs, sample
from ssdlocal.draft.base import Proposal, align_vocab
from ssdlocal.spec.ngram import propose_ngram


class NgramDrafter:
    """Prompt-lookup proposals; deterministic, so verified as point masses (q=None)."""

    def __init__(self, k: int, n_max: int = 3, n_min: int = 1, device="cpu") -> None:
        self.k = k
        self.n_max = n_max
        self.n_min = n_min
        self.device = device  # where the target verifies

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        return None

    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        tokens = [
            propose_ngram(seq, self.k, self.n_max, self.n_min) if on else []
            for seq, on in zip(sequences, active)
        ]
        return Proposal.from_lists(tokens, self.k, self.device)

    def observe(self, sequences, n_accepted, bonus, active, verdict=None) -> None:
        return None

    def close(self) -> None:
        return None


class ModelDrafter:
    """A draft model run just in time: K forwards per round, batched over rows, with the
    draft's tokens, positions and distributions kept on its device (no host round trip
    between the K steps).

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
        self.generator = self._generator()

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.runner.device).manual_seed(self.params.stream_seed(7919))

    def reserve(self, batch_size: int, num_slots: int) -> None:
        """Allocate the draft's KV cache for a batch (engine calls before start)."""
        self.runner.reset(batch_size, num_slots)
        self.generator = self._generator()

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        """Prefill the draft on every row's sequence except its last token."""
        self.runner.feed([list(seq[:-1]) for seq in sequences], "none")
        self.runner.begin_steps()
        dev = self.runner.device
        self.last = torch.tensor([seq[-1] for seq in sequences], device=dev)  # [B] pending bonus
        self.last_draft = torch.zeros_like(self.last)  # [B] d_K of the previous round
        self.two = torch.zeros(len(sequences), dtype=torch.long, device=dev)  # [B] 1 if d_K pending

    @torch.inference_mode()
    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        batch, runner = len(sequences), self.runner
        bound = max(map(len, sequences)) + self.k  # past every write of this round
        rows = torch.arange(batch, device=runner.device)  # [B]
        if runner.device.type == "cpu" and not bool(self.two.any()):
            # only the bonus is pending: on a CPU a 1-token step costs less than a 2-token one
            # (no graphs to keep the shape for; reading `two` costs no device sync)
            logits = runner.step(self.last[:, None], bound)[:, 0]  # [B, V_d]
        else:
            first = torch.stack([torch.where(self.two.bool(), self.last_draft, self.last), self.last], 1)
            logits = runner.step(first, bound)[rows, self.two]  # [B, V_d]: after the last pending token
        runner.advance(1 + self.two)
        drafts, qs = [], []
        for j in range(self.k):
            if j > 0:
                logits = runner.step(drafts[-1][:, None], bound)[:, 0]  # [B, V_d]
                runner.advance(1)
            token, q = self._draw(logits)
            drafts.append(token)
            qs.append(q)
        self.last_draft = drafts[-1]
        n_draft = torch.tensor([self.k if a else 0 for a in active], device=self.device)  # [B]
        q_all = None if self.params.greedy else torch.stack(qs, dim=1).to(self.device)  # [B, K, V]
        return Proposal(torch.stack(drafts, dim=1).to(self.device), n_draft, q_all)  # [B, K]

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [B, V_d] -> (token [B], q [B, V] or None when greedy)."""
        aligned = align_vocab(logits, self.target_vocab)  # [B, V]
        if self.params.greedy:
            return torch.argmax(aligned, dim=-1), None  # [B]
        q = logits_to_probs(aligned, self.params)  # [B, V]
        return sample(q, self.generator), q

    @torch.inference_mode()
    def observe(self, sequences, n_accepted, bonus, active, verdict=None) -> None:
        """Keep L + min(n, K-1) cached tokens per active row; finished rows rewind to
        where this round started (so their positions never run past the cache)."""
        dev = self.runner.device
        n = torch.tensor(list(n_accepted), device=dev) if verdict is None else verdict.n_accepted.to(dev)
        live = torch.tensor(list(active), device=dev)  # [B] bool
        fed = self.two + self.k  # [B] tokens fed this round
        keep = 1 + self.two + n.clamp(max=self.k - 1)  # [B] of them still valid
        self.runner.advance(torch.where(live, keep - fed, -fed))
        self.two = (n == self.k).long() & live.long()  # [B]
        self.last = torch.tensor(list(bonus), device=dev) if verdict is None else verdict.bonus.to(dev)

    def close(self) -> None:
        return None
