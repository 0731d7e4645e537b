"""The Drafter protocol, the Proposal it returns and the RoundOutcome it learns from.

A drafter proposes up to K tokens per active row and says which distribution each
token was drawn from (`q`), so verification stays lossless. Proposals live on the
target's device. Data flows one way per step: the engine hands the drafter read-only
views of its rows once (`start`), asks for proposals (`propose(active)`) and tells it
what each round decided (`observe(RoundOutcome)`); a drafter never keeps or diffs copies
of the rows. A drafter must not know about the target model or the stopping rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ssdlocal.backends.base import Runner
from ssdlocal.core.events import SsdRound
from ssdlocal.core.hostsync import detached_site

if TYPE_CHECKING:  # annotations only: no import of these at run time
    from ssdlocal.core.config import SamplingParams
    from ssdlocal.core.hostsync import Audit
    from ssdlocal.core.verify import Verdict
    from ssdlocal.grammar.guide import Guides
    from ssdlocal.speculation.adaptive import CostModel
    from ssdlocal.speculation.suffix import SuffixMemory


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round, where the target verifies them.

    drafts: [B, K] long on the target's device; entries past n_draft[b] are padding.
    n_draft: [B] long on the target's device, real drafts per row (0 for idle rows).
    q: [B, K, V] float32 on the target's device, the distributions the drafts were drawn
       from, or None when every draft is a deterministic choice (point mass: greedy or
       n-gram).
    tokens: the same drafts as host lists when the drafter has them (else the engine
       reads them back with the verdict).
    sources: where each row's drafts came from, when a drafter mixes sources.
    ssd: SSD only (core.events.SsdRound, per row b of the batch): cache hits, the backup
       that drafted the missed rows, the worker's compute.
    """

    drafts: torch.Tensor
    n_draft: torch.Tensor
    q: torch.Tensor | None = None
    tokens: list[list[int]] | None = None
    sources: tuple[str, ...] | None = None  # per row: "model" | "suffix" | "none" (adaptive drafter)
    ssd: SsdRound | None = None

    @property
    def cache_hit(self) -> tuple[bool, ...] | None:
        """Per row: served from the speculation cache (None: not SSD)."""
        return self.ssd.cache_hit if self.ssd is not None else None

    @classmethod
    def from_lists(cls, tokens: Sequence[Sequence[int]], k: int, device, site=None, **fields) -> Proposal:
        """Host token lists (0..K per row) -> drafts and n_draft on `device`, in one staged
        upload through `site` (a core.hostsync.Site; default: one nobody reads)."""
        site = site or detached_site("target")
        host = torch.tensor([[len(t)] + list(t) + [0] * (k - len(t)) for t in tokens], dtype=torch.long)
        both = site.upload(host.reshape(len(tokens), k + 1), device)  # [B, 1+K]: n_draft, drafts
        return cls(both[:, 1:], both[:, 0], tokens=[list(t) for t in tokens], **fields)


class RowView(Protocol):
    """A row as drafters see it (core.sequence.Row): read, never written."""

    @property
    def tokens(self) -> list[int]:
        """Prompt + committed tokens, the last of which the target has not cached yet."""

    @property
    def length(self) -> int:
        """len(tokens), without building the list."""

    def tail(self, start: int) -> list[int]:
        """tokens[start:], building only that part."""


@dataclass(frozen=True)
class RoundOutcome:
    """What one round decided, built once by the engine's commit step.

    appended[b]: the tokens row b took this round (accepted drafts, then the bonus token,
        cut by the stopping rules); () for rows that were idle.
    n_accepted[b], bonus[b]: the verdict per row, on the host.
    active[b]: whether row b goes on (False once finished: never proposed for again).
    verdict: the same n_accepted and bonus on the target's device (core.verify.Verdict).
    draft_s, verify_s: what the round cost (for drafters that choose K by cost).
    """

    appended: tuple[tuple[int, ...], ...]
    n_accepted: tuple[int, ...]
    bonus: tuple[int, ...]
    active: tuple[bool, ...]
    verdict: Verdict | None = None
    draft_s: float = 0.0  # the round's proposal time
    verify_s: float = 0.0  # the round's scoring + verification + read-back time


class Drafter(Protocol):
    """What the engine calls, in this order: read_prompts, start, then (propose, observe)
    per round, store_prefixes when the call ended normally, and close.

    Optional: `read_ahead(tokens, n)` (between rounds, serving): a drafter with a model of
    its own reads up to `n` more of `tokens`, a prompt waiting to join, into its prefix
    store (the target reads the same prompt ahead; engine/ahead.py)."""

    k: int

    def read_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """The call's prompts, before the target reads them: a drafter on hardware of its
        own may start reading them now (the first token never waits for the draft)."""

    def start(self, rows: Sequence[RowView]) -> None:
        """A new batch: `rows` are the engine's rows (prompt + first token so far); the
        drafter may read them whenever it proposes, and must not change them."""

    def propose(self, active: Sequence[bool]) -> Proposal:
        """Draft up to K tokens for every active row, continuing its tokens."""

    def observe(self, outcome: RoundOutcome) -> None:
        """What the round decided (the rows already hold the appended tokens)."""

    def store_prefixes(self) -> None:
        """The call ended normally: keep what the draft model's cache holds of the rows in
        its prefix cache, for later calls (a drafter without a model: nothing)."""

    def close(self) -> None:
        """Release processes and memory. Idempotent."""


@dataclass(frozen=True)
class DraftResources:
    """What the engine offers the drafter of one call (a builder takes what it needs)."""

    target_vocab: int
    target_device: torch.device  # where the target verifies
    target_device_name: str  # rank 0 of the target, as configured ("cpu", "cuda:N")
    batch: int
    num_slots: int  # the target's main slots per row (SlotLayout.for_generation)
    draft_runner: Callable[[], Runner]  # the draft model in this process (loaded on demand)
    # the SSD draft worker, a draft.ssd.client.DraftWorkerClient (started on demand); Any because
    # naming the class here would make draft.base and draft.ssd.client import each other
    worker: Callable[[], Any]
    memory: SuffixMemory | None = None  # the engine's, across calls
    costs: CostModel | None = None  # the engine's, across calls
    rates: dict | None = None  # acceptance by source, the engine's, across calls (Acceptance.shared)
    guides: Guides | None = None  # the call's constrained rows (None: no grammar)
    audit: Audit | None = None  # the engine's, counting host waits per model
    row_params: tuple[SamplingParams, ...] = ()  # each row's sampling settings (empty: the call's params)
