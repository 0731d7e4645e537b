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

    def __init__(self, k: int, n_max: int = 3, n_min: int = 1) -> None:
        self.k = k
        self.n_max = n_max
        self.n_min = n_min

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        return None

    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        tokens = [
            propose_ngram(seq, self.k, self.n_max, self.n_min) if on else []
            for seq, on in zip(sequences, active)
        ]
        return Proposal(tokens=tokens, q=None)

    def observe(self, sequences, n_accepted, bonus, active) -> None:
        return None

    def close(self) -> None:
        return None


class ModelDrafter:
    """A draft model run just-in-time: K forwards per round, batched over rows."""

    def __init__(
        self,
        runner,  # backends.base.Runner of the draft model
        k: int,
        params: SamplingParams,
        target_vocab: int,
    ) -> None:
        self.runner = runner
        self.k = k
        self.params = params
        self.target_vocab = target_vocab
        self.generator = torch.Generator().manual_seed(params.stream_seed(7919))

    def reserve(self, batch_size: int, num_slots: int) -> None:
        """Allocate the draft's KV cache for a batch (engine calls before start)."""
        self.runner.reset(batch_size, num_slots)
        self.generator = torch.Generator().manual_seed(self.params.stream_seed(7919))

    def start(self, sequences: Sequence[Sequence[int]]) -> None:
        """Prefill the draft on every row's sequence except its last token."""
        self.runner.feed([list(seq[:-1]) for seq in sequences])

    def propose(self, sequences: Sequence[Sequence[int]], active: Sequence[bool]) -> Proposal:
        batch = len(sequences)
        rows = [self.runner.pending(b, seq) if active[b] else [] for b, seq in enumerate(sequences)]
        tokens: list[list[int]] = [[] for _ in range(batch)]
        q_steps: list[torch.Tensor] = []
        for _ in range(self.k):
            logits = self.runner.feed(rows)  # per row [len, V_d]
            last = torch.stack(
                [
                    lg[-1] if len(lg) else torch.zeros(lg.shape[-1])
                    for lg in logits
                ]
            )  # [B, V_d]
            q = logits_to_probs(align_vocab(last, self.target_vocab), self.params)  # [B, V]
            drawn = sample(q, self.generator)  # [B]
            q_steps.append(q)
            rows = []
            for b in range(batch):
                if active[b]:
                    tokens[b].append(int(drawn[b]))
                    rows.append([int(drawn[b])])
                else:
                    rows.append([])
        q_all = None if self.params.greedy else torch.stack(q_steps, dim=1)  # [B, K, V]
        return Proposal(tokens=tokens, q=q_all)

    def observe(self, sequences, n_accepted, bonus, active) -> None:
        for b, seq in enumerate(sequences):
            self.runner.sync(b, seq)

    def close(self) -> None:
        return None
