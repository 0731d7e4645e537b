"""The Drafter protocol, the Proposal it returns and the RoundOutcome it learns from.

A drafter proposes up to K tokens per active row and says which distribution each
token was drawn from (`q`), so verification stays lossless. Proposals live on the
target's device. Data flows one way per step: the engine hands the drafter read-only
views of its rows once (`start`), asks for proposals (`propose(active)`) and tells it
what each round decided (`observe(RoundOutcome)`); a drafter never keeps or diffs copies
of the rows. A drafter must not know about the target model or the stopping rules.

What a drafter can do beyond that is declared, never probed: `DrafterBase` gives every
optional verb a default (`read_ahead` reads nothing, `graph_report` and `host_waits` report
none), and a drafter that reads the target's hidden states says which (`hidden`, a
`HiddenLayers`): the engine then asks the target's runner for them and hands them over in
`start` (the prompt's last position) and in every RoundOutcome (each scored position).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ssdlocal.backends.base import HiddenLayers, Runner
from ssdlocal.core.events import SsdRound
from ssdlocal.core.hostsync import HostWaits, detached_site

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


@dataclass(frozen=True)
class PromptHidden:
    """The target's hidden states (Drafter.hidden) over what it read of each row's tokens
    when the batch was seated: `states` [B, T, len(layers) * D]; row b's first `fed[b]`
    columns are its positions start[b], start[b] + 1, ... (the rest is padding). A row's
    earlier positions came from the prefix cache, or an earlier seating."""

    states: torch.Tensor
    start: tuple[int, ...]
    fed: tuple[int, ...]


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
    hidden: for a drafter that asked (Drafter.hidden), the target's hidden states at every
        scored position [B, T, len(layers) * D] on its device (position 0: the row's
        pending token, then its drafts; rows continue from position n_accepted[b]); valid
        until the next round's step. None otherwise.
    """

    appended: tuple[tuple[int, ...], ...]
    n_accepted: tuple[int, ...]
    bonus: tuple[int, ...]
    active: tuple[bool, ...]
    verdict: Verdict | None = None
    draft_s: float = 0.0  # the round's proposal time
    verify_s: float = 0.0  # the round's scoring + verification + read-back time
    hidden: torch.Tensor | None = None


class Drafter(Protocol):
    """What the engine calls, in this order: read_prompts, start, then (propose, observe)
    per round, store_prefixes when the call ended normally, and close; `read_ahead` between
    rounds while serving; `graph_report` and `host_waits` whenever the call's stats are
    read. `hidden`: the target's hidden states the drafter reads (None: none)."""

    k: int
    hidden: HiddenLayers | None

    def read_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """The call's prompts, before the target reads them: a drafter on hardware of its
        own may start reading them now (the first token never waits for the draft)."""

    def start(self, rows: Sequence[RowView], hidden: PromptHidden | None = None) -> None:
        """A new batch: `rows` are the engine's rows (prompt + first token so far); the
        drafter may read them whenever it proposes, and must not change them. `hidden`
        (when the drafter asked): the target's hidden states at every position it read for
        the rows now (PromptHidden)."""

    def propose(self, active: Sequence[bool]) -> Proposal:
        """Draft up to K tokens for every active row, continuing its tokens."""

    def observe(self, outcome: RoundOutcome) -> None:
        """What the round decided (the rows already hold the appended tokens)."""

    def store_prefixes(self) -> None:
        """The call ended normally: keep what the draft model's cache holds of the rows in
        its prefix cache, for later calls (a drafter without a model: nothing)."""

    def read_ahead(self, tokens: Sequence[int], n: int) -> None:
        """Serving, between rounds: read up to `n` more of `tokens` (a prompt waiting to
        join) into the draft model's prefix store (the target reads the same prompt ahead;
        engine/ahead.py). A drafter without a model of its own reads nothing."""

    def graph_report(self, since: dict | None = None) -> dict | None:
        """The draft model's captured-step counts (backends.base.Runner.graph_report), minus
        `since`; None for a drafter without a model (or whose counts are not known yet)."""

    def host_waits(self) -> HostWaits | None:
        """Host waits counted in another process (the SSD worker's), or None."""

    def close(self) -> None:
        """Release processes and memory. Idempotent."""


class DrafterBase:
    """The optional parts of the Drafter contract, as no-ops: a drafter inherits what it
    does not do (it reads no hidden states, nothing ahead, keeps no prefixes, reports
    neither graphs nor waits of its own)."""

    hidden: HiddenLayers | None = None

    def read_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        return None

    def store_prefixes(self) -> None:
        return None

    def read_ahead(self, tokens: Sequence[int], n: int) -> None:
        return None

    def graph_report(self, since: dict | None = None) -> dict | None:
        return None

    def host_waits(self) -> HostWaits | None:
        return None

    def close(self) -> None:
        return None


def _none_here() -> Runner:
    raise RuntimeError("no draft model was offered to this drafter")  # a caller bug


def _no_worker() -> Any:
    raise RuntimeError("no SSD worker was offered to this drafter")  # a caller bug


@dataclass(frozen=True)
class DraftResources:
    """What the engine offers the drafter of one seating (a builder takes what it needs):
    the seating's own facts, then what the engine's draft side adds (engine/drafts.py)."""

    target_vocab: int
    target_device: torch.device  # where the target verifies
    batch: int
    num_slots: int  # the target's main slots per row (SlotLayout.for_generation)
    memory: SuffixMemory | None = None  # the engine's, across calls
    costs: CostModel | None = None  # the engine's, across calls
    rates: dict | None = None  # acceptance by source, the engine's, across calls (Acceptance.shared)
    guides: Guides | None = None  # the call's constrained rows (None: no grammar)
    row_params: tuple[SamplingParams, ...] = ()  # each row's sampling settings (empty: the call's params)
    hidden_size: int = 0  # the target's hidden width D (what a drafter reading hidden states receives per layer)
    audit: Audit | None = None  # the engine's, counting host waits per model
    target_device_name: str = "cpu"  # rank 0 of the target, as configured ("cpu", "cuda:N")
    target: Runner | None = None  # the target's runner (a draft head shares its embeddings: head_inputs)
    draft_runner: Callable[[], Runner] = _none_here  # the draft model in this process (loaded on demand)
    # the SSD draft worker, a draft.ssd.client.DraftWorkerClient (started on demand); Any because
    # naming the class here would make draft.base and draft.ssd.client import each other
    worker: Callable[[], Any] = _no_worker
