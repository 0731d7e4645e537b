"""What a generate call asks beyond sampling: grammar masks and log-probabilities.

`Shaper` sits between the target's logits and verification in every mode. With grammars
(grammar.guide.Guides) it masks each verified position with what the row's grammar allows
after the prefix up to it, so verification — unchanged — accepts and samples from the
constrained, renormalised p; after commit the rows' matchers follow the tokens taken. With
`logprobs` it reads the log-probabilities of the emitted tokens (and top alternatives) from
the same logits, at the positions verification already scored: no extra target forward.
A call with neither costs nothing here.

Host waits (core.hostsync): a drafter that walked the grammar hands over its drafts as
host lists; otherwise `prepare` reads them once, before the target's forward is launched,
so that the last mask walk runs on the host while the device runs the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ssdlocal.core.events import TokenLogprob
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.logprobs import to_host, token_logprobs
from ssdlocal.core.sequence import FinishReason, Row
from ssdlocal.core.verify import mask_logits


class Shaper:
    """Masks and log-probabilities for one generate call's rounds."""

    def __init__(self, guides=None, logprobs: int | None = None, audit: Audit | None = None) -> None:
        self.guides = guides  # grammar.guide.Guides, or None when no row has a grammar
        self.logprobs = logprobs  # alternatives per token, or None: no log-probabilities
        self.site = (audit or Audit()).site("target")  # the target's host waits
        self.first_logprobs: list[tuple[TokenLogprob, ...]] | None = None

    @classmethod
    def for_rows(cls, rows: Sequence[Row], vocab_size: int, eos_ids, audit: Audit | None = None) -> Shaper:
        """The Shaper of one batch: a matcher per row whose request has a grammar (a row's
        own `guide` from an earlier batch goes on; a new one is kept on the row), and the
        most log-probability alternatives any row asked for (None: no row asked); host
        waits counted in `audit` (core.hostsync; default: one nobody reads)."""
        audit = audit or Audit()
        grammars = [row.request.grammar if row.request is not None else None for row in rows]
        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        guides = None
        if any(g is not None for g in grammars):
            from ssdlocal.grammar.guide import Guides

            guides = Guides(grammars, vocab_size, sorted(eos_ids), audit, [row.guide for row in rows])
            for row, guide in zip(rows, guides.rows):
                row.guide = guide
        return cls(guides, max(asked) if asked else None, audit)

    def first_token(
        self, logits: torch.Tensor, sampling, fresh: Sequence[bool] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """The prefill's last logits [B, 1, V] -> each row's first token ([B] on the device,
        and as a host list: one read), masked by its grammar, which then consumes it; keeps
        its log-probabilities in `first_logprobs`. `sampling`: engine.request.RowSampling.
        `fresh[b]` False: row b carries on from an earlier batch (its token is not drawn
        from these logits: nothing is masked, consumed or kept for it)."""
        batch = logits.shape[0]
        no_drafts = torch.zeros(batch, 0, dtype=torch.long, device=logits.device)  # [B, 0]
        active = list(fresh) if fresh is not None else [True] * batch
        if self.guides is not None:
            with self.guides.timing(active):
                logits = mask_logits(logits, self.guides.allowed([[]] * batch, 0, active, logits.device))
        first = sampling.verify(logits, no_drafts, None).bonus  # [B]
        host = [[t] for t in self.site.read(first)]
        if self.logprobs is not None:
            self.first_logprobs = self._read(logits, first[:, None], host, self.logprobs)
        if self.guides is not None:
            self.guides.commit(host, active)
        return first, [h[0] for h in host]

    def prepare(self, proposal):
        """Before the target's forward: the proposal with its drafts on the host when a
        grammar will walk them (one read, unless the drafter handed them over)."""
        if self.guides is None or proposal.tokens is not None:
            return proposal
        counts, rows = self.site.read(proposal.n_draft, proposal.drafts)
        return replace(proposal, tokens=[r[:n] for r, n in zip(rows, counts)])

    def mask(self, logits: torch.Tensor, proposal, active: Sequence[bool]):
        """(logits [B, T, V] masked per position, the proposal with its drafts on the host)."""
        if self.guides is None:
            return logits, proposal
        proposal = self.prepare(proposal)  # a no-op when the round prepared it (read_back reuses them)
        width = logits.shape[1] - 1
        with self.guides.timing(active):
            allowed = self.guides.allowed(proposal.tokens, width, active, logits.device)  # [B, T, V]
            return mask_logits(logits, allowed), proposal

    def round_logprobs(self, logits: torch.Tensor, drafts, n_accepted, bonus) -> list | None:
        """Per row, the TokenLogprobs of its accepted drafts and bonus token (host lists in)."""
        top = self.logprobs
        if top is None:
            return None
        width = logits.shape[1]
        host = [list(d[:n]) + [b] for d, n, b in zip(drafts, n_accepted, bonus)]
        chosen = self.site.upload([h + [0] * (width - len(h)) for h in host], logits.device)  # [B, T]
        return self._read(logits, chosen, host, top)

    def _read(self, logits, chosen, host, top: int) -> list[tuple[TokenLogprob, ...]]:
        """Per row, the TokenLogprobs (with `top` alternatives) of the tokens `host[b]`, whose
        ids `chosen` [B, T] holds on the device: one host read for the three tensors."""
        picked, ids, values = token_logprobs(logits, chosen, top)
        p, i, v = self.site.read(picked, ids, values)  # three tensors in -> three lists out
        return to_host(p, i, v, host)

    def commit(self, emitted: Sequence[Sequence[int]], active: Sequence[bool]) -> None:
        if self.guides is not None:
            self.guides.commit(emitted, active)

    def end_failed(self, rows) -> None:
        """Rows whose grammar the engine failed on (grammar.guide.RowGuide.error) end with
        finish_reason "error" and its message. Such a row's masks allow only EOS from the
        failure on, so it ends with its next token (the same tokens in every mode); this
        names why once it has."""
        if self.guides is None:
            return
        for b, message in self.guides.errors().items():
            row = rows[b]
            if row.finish_reason is not None and row.finish_reason is not FinishReason.CANCELLED:
                row.finish_reason, row.error = FinishReason.ERROR, message

    def seconds(self, live: Sequence[int]) -> tuple[tuple[bool, ...] | None, tuple[float, ...] | None]:
        """(constrained, grammar seconds since the last call) of the rows `live`."""
        if self.guides is None:
            return None, None
        spent = self.guides.take_seconds()
        return tuple(self.guides.constrained[b] for b in live), tuple(spent[b] for b in live)
