"""The adaptive drafter: per round, K and the source (draft model, suffix memory, none).

Wraps an optional ModelDrafter and an optional SuffixSource. Each round it asks the suffix
source for its proposals (cheap), lets speculation/adaptive.py pick the draft model's K
(0: no model forwards this round) and which rows take their suffix proposal instead, and
builds one Proposal: the drafts per row, and q = the model's distribution for model
drafts, a point mass for suffix drafts (so verification stays exact at any temperature).
It learns from each RoundOutcome: acceptance per row and source, and the round's costs.
With `pinned` K the model always drafts K and a row's suffix proposal replaces it only
when it predicts more accepted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.hostsync import Audit
from ssdlocal.draft.base import DrafterBase, Proposal, RoundOutcome, RowView
from ssdlocal.speculation.adaptive import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    Acceptance,
    Choice,
    CostModel,
    choose,
    model_could_pay,
    suffix_key,
)

MODEL, SUFFIX, NONE = "model", "suffix", "none"
PROBE_CATCH_UP = 64  # committed tokens the draft model may lack for a probe to be worth it


@dataclass
class _Round:
    """What the last proposal was, for observe."""

    choice: Choice
    sources: tuple[str, ...]
    lengths: tuple[int, ...]
    keys: tuple[str, ...]  # each row's suffix acceptance class


class AdaptiveDrafter(DrafterBase):
    """Drafter protocol over a draft model and/or suffix proposals, K chosen per round."""

    def __init__(
        self,
        model,
        suffix,
        *,
        k: int,
        pinned: bool,
        params: SamplingParams,
        costs: CostModel,
        target_vocab: int,
        device,
        shared_rates: dict | None = None,
        audit: Audit | None = None,
    ) -> None:
        self.model = model  # draft.sync.ModelDrafter or None
        self.suffix = suffix  # draft.suffix.SuffixSource or None
        self.k = k  # the most drafts a round may have (pinned: the model's K every round)
        self.pinned = pinned
        self.params = params
        self.costs = costs  # the engine's: kept across calls
        self.target_vocab = target_vocab
        self.device = device
        self.site = (audit or Audit()).site("target")  # the proposal's one staged upload
        self.acceptance = Acceptance(shared_rates if shared_rates is not None else {})
        self.rows: Sequence[RowView] = ()
        self.last: _Round | None = None
        self._since_model = 0  # rounds since the model last proposed
        self._since_spec = 0  # rounds since anything was proposed

    def graph_report(self, since: dict | None = None) -> dict | None:
        """Drafter.graph_report: the draft model's, when there is one."""
        return None if self.model is None else self.model.graph_report(since)

    def read_prompts(self, prompts) -> None:
        if self.model is not None:
            self.model.read_prompts(prompts)

    def store_prefixes(self) -> None:
        if self.model is not None:
            self.model.store_prefixes()

    def read_ahead(self, tokens, n: int) -> None:
        """Drafter.read_ahead: the draft model's (suffix proposals need no reading)."""
        if self.model is not None:
            self.model.read_ahead(tokens, n)

    def start(self, rows: Sequence[RowView], hidden=None) -> None:
        self.rows = rows
        for source in (self.model, self.suffix):
            if source is not None:
                source.start(rows)

    # ------------------------------------------------------------------ propose
    def propose(self, active: Sequence[bool]) -> Proposal:
        suffix = self.suffix.proposals(active, self.k) if self.suffix is not None else None
        confs = [p.confidence for p in suffix] if suffix else [()] * len(active)
        keys = [suffix_key(p.match_len) for p in suffix] if suffix else [SUFFIX] * len(active)
        choice = self._choose(active, confs, keys)
        model = self.model.propose(active, choice.model_k) if choice.model_k else None
        lengths = [n if on else 0 for n, on in zip(choice.suffix_len, active)]
        sources = tuple(
            NONE if not on else SUFFIX if n else MODEL if choice.model_k else NONE for n, on in zip(lengths, active)
        )
        n_draft = [n if s == SUFFIX else choice.model_k if s == MODEL else 0 for n, s in zip(lengths, sources)]
        self.last = _Round(choice, sources, tuple(n_draft), tuple(keys))
        self._since_model = 0 if choice.model_k else self._since_model + 1
        self._since_spec = 0 if choice.width else self._since_spec + 1
        return self._proposal(choice.width, model, suffix, sources, n_draft)

    def _choose(self, active: Sequence[bool], confs, keys) -> Choice:
        rows = range(len(active))
        rates = [self.acceptance.rate(b, MODEL) for b in rows] if self.model is not None else None
        suffix_rates = [self.acceptance.rate(b, key) for b, key in zip(rows, keys)]
        if self.pinned:
            return self._pinned(active, confs, rates, suffix_rates)
        choice = choose(self.costs, rates, confs, suffix_rates, self.k, active, catch_up=self._catch_up())
        if (
            self.model is not None
            and not choice.width
            and self._since_model >= self.costs.probe_every
            and self._catch_up() <= PROBE_CATCH_UP
            and self._model_could_pay(active)
        ):  # a probe must not cost a long prefill, nor try a model no acceptance makes pay
            self.costs.probe_every = min(
                2 * self.costs.probe_every, MAX_PROBE_EVERY
            )  # a probe that does not pay: rarer (engine-wide)
            probe = min(2, self.k)  # the model's acceptance goes stale unless tried now and then
            return Choice(probe, (0,) * len(active), max(probe, choice.width), choice.tokens_per_s)
        if choice.model_k and self._since_model:  # chosen on its merits: probe at the usual pace
            self.costs.probe_every = PROBE_EVERY
        if choice.width:  # speculation on its merits: wider steps are timed as it runs
            self.costs.explore_every = PROBE_EVERY
        elif self._since_spec >= self.costs.explore_every:  # so do the costs of wider steps
            self.costs.explore_every = min(2 * self.costs.explore_every, MAX_PROBE_EVERY)  # rarer while nothing pays
            return choose(self.costs, rates, confs, suffix_rates, self.k, active, explore=True)
        return choice

    def _model_could_pay(self, active: Sequence[bool]) -> bool:
        """speculation.adaptive.model_could_pay on this drafter's costs and K."""
        return model_could_pay(self.costs, self.k, active)

    def _drafting_s(self, draft_s: float, k: int) -> float:
        """A model round's draft time as a steady model round has it. A round that follows
        a model round reads at most K+1 committed tokens before drafting; a probe after plain
        rounds (or the prompt's first read) reads more, once, and `choose` charges that
        through `catch_up`. Counting it per drafted token made one probe's catch-up of 63
        tokens read as 3.7x the draft's cost, which kept the model from ever being tried
        again once probes ask whether it could pay."""
        fed, seconds = self.model.last_read
        steady = k + 1
        if fed <= steady or seconds <= 0.0:
            return draft_s
        return max(draft_s - seconds * (fed - steady) / fed, 0.0)

    def _catch_up(self) -> int:
        """Committed tokens the draft model lacks (the most of any row)."""
        if self.model is None:
            return 0
        cached = self.model.cached or [0] * len(self.rows)
        return max((row.length - c for row, c in zip(self.rows, cached)), default=0)

    def _pinned(self, active, confs, rates, suffix_rates) -> Choice:
        """K drafts every round: the model's, or a row's suffix proposal where it predicts more.
        Without a model the round is as wide as the longest suffix proposal (0: a plain step)."""
        from ssdlocal.speculation.adaptive import expected_tokens, suffix_expected

        model_k = self.k if self.model is not None else 0
        lens = []
        for b, on in enumerate(active):
            n = min(len(confs[b]), self.k)
            m = expected_tokens(rates[b], model_k) if rates is not None else 1.0
            lens.append(n if on and n and suffix_expected(confs[b][:n], suffix_rates[b]) >= m else 0)
        return Choice(model_k, tuple(lens), self.k if model_k else max(lens, default=0), 0.0)

    def _proposal(self, width, model: Proposal | None, suffix, sources, n_draft) -> Proposal:
        """Drafts [B, width] (model drafts, or suffix tokens), q for the model's rows; the host
        data (n_draft, suffix tokens, which rows took them) goes up in one staged upload."""
        host = [list(suffix[b].tokens[: n_draft[b]]) if s == SUFFIX else [] for b, s in enumerate(sources)]
        if model is None or MODEL not in sources:  # point masses only: the host has every draft
            return Proposal.from_lists(host, width, self.device, self.site, sources=sources)
        staged = self.site.upload(
            [[n_draft[b], int(s == SUFFIX)] + host[b] + [0] * (width - len(host[b])) for b, s in enumerate(sources)],
            self.device,
        )  # [B, 2+W]
        n, use_suffix, suffix_drafts = staged[:, 0], staged[:, 1].bool(), staged[:, 2:]  # [B], [B], [B, W]
        model_drafts = torch.zeros_like(suffix_drafts)  # [B, W]
        model_drafts[:, : model.drafts.shape[1]] = model.drafts
        drafts = torch.where(use_suffix[:, None], suffix_drafts, model_drafts)  # [B, W]
        q = None
        if model.q is not None:
            q = torch.zeros(len(sources), width, self.target_vocab, device=self.device)  # [B, W, V]
            q[:, : model.q.shape[1]] = model.q
            real = torch.arange(width, device=self.device)[None, :] < n[:, None]  # [B, W]
            point = torch.nn.functional.one_hot(suffix_drafts, self.target_vocab).float() * real[..., None]  # [B, W, V]
            q = torch.where(use_suffix[:, None, None], point, q)  # [B, W, V]: point masses for suffix rows
        tokens = None
        if model.tokens is not None:  # the model's drafts are on the host already (a grammar walked them)
            tokens = [
                host[b] if s == SUFFIX else list(model.tokens[b]) if s == MODEL else [] for b, s in enumerate(sources)
            ]
        return Proposal(drafts, n, q, tokens=tokens, sources=sources)

    # ------------------------------------------------------------------ observe
    def observe(self, outcome: RoundOutcome) -> None:
        last = self.last
        if last is not None:
            for b, (source, n) in enumerate(zip(last.sources, last.lengths)):
                if source != NONE and outcome.appended[b]:
                    key = last.keys[b] if source == SUFFIX else source
                    self.acceptance.observe(b, key, n, min(outcome.n_accepted[b], n))
            self.costs.observe_target(last.choice.width + 1, outcome.verify_s)
            if last.choice.model_k:
                self.costs.observe_draft(last.choice.model_k, self._drafting_s(outcome.draft_s, last.choice.model_k))
        if self.model is not None and last is not None and last.choice.model_k:
            self.model.observe(outcome, adopted=[s == MODEL for s in last.sources])
        if self.suffix is not None:
            self.suffix.observe(outcome)

    def close(self) -> None:
        for source in (self.model, self.suffix):
            if source is not None:
                source.close()


def build_adaptive(spec, params, resources, model, suffix) -> AdaptiveDrafter:
    """An adaptive drafter over `model` (a ModelDrafter or None) and the suffix proposals
    `suffix` asks for (a SuffixDraft, or None: none)."""
    from ssdlocal.draft.suffix import SuffixSource

    memory = resources.memory if suffix is not None and suffix.use_memory else None
    source = None if suffix is None else SuffixSource(memory, suffix.min_confidence)
    return AdaptiveDrafter(
        model,
        source,
        k=spec.k,
        pinned=not spec.adaptive_k,
        params=params,
        costs=resources.costs,
        target_vocab=resources.target_vocab,
        device=resources.target_device,
        shared_rates=resources.rates,
        audit=resources.audit,
    )


def build_suffix(spec, params, resources) -> AdaptiveDrafter:
    """The drafter of a SuffixDraft (its row in draft.factory.BUILDERS)."""
    return build_adaptive(spec, params, resources, None, spec.draft)
