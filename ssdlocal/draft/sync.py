"""Synchronous drafters: the n-gram (prompt-lookup) proposer and a draft model in-process.

Both run on the target's thread between verifications (SD). The SSD worker has its
own drafting code (draft/ssd/speculator.py), which also decodes fan-out trees; its
just-in-time backup uses the same K-step decoder (draft/decode.py) as ModelDrafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.backends.base import Logits
from ssdlocal.core.clock import DeviceClock
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.models import NgramDraft
from ssdlocal.draft.base import DrafterBase, Proposal, RoundOutcome, RowView
from ssdlocal.draft.decode import DraftDecoder, Drafting
from ssdlocal.speculation.ngram import propose_ngram


def build_ngram(spec, params, resources) -> NgramDrafter:
    """The drafter of an NgramDraft (its row in draft.factory.BUILDERS)."""
    return NgramDrafter(spec.k, spec.draft, resources.target_device, resources.audit)


class NgramDrafter(DrafterBase):
    """Prompt-lookup proposals; deterministic, so verified as point masses (q=None)."""

    def __init__(self, k: int, draft: NgramDraft = NgramDraft(), device="cpu", audit: Audit | None = None) -> None:
        self.k = k
        self.draft = draft
        self.device = device  # where the target verifies
        self.site = (audit or Audit()).site("target")  # the proposals' one staged upload
        self.rows: Sequence[RowView] = ()

    def start(self, rows: Sequence[RowView], hidden=None) -> None:
        self.rows = rows

    def propose(self, active: Sequence[bool]) -> Proposal:
        """Up to K tokens per row, padded to the longest row's proposal (not to K: where no
        row matches, the round scores one token, a plain step)."""
        tokens = [
            propose_ngram(row.tokens, self.k, self.draft.n_max, self.draft.n_min) if on else []
            for row, on in zip(self.rows, active)
        ]
        return Proposal.from_lists(tokens, max(map(len, tokens), default=0), self.device, self.site)

    def observe(self, outcome: RoundOutcome) -> None:
        return None


CATCH_UP = 32  # most committed tokens one catch-up step feeds per row


class ModelDrafter(DrafterBase):
    """A draft model run just in time: K forwards per round, batched over rows, with the
    draft's tokens, positions and distributions kept on its device (draft/decode.py).

    The drafter keeps, per row, how many of the row's committed tokens the draft holds
    (`cached`, on the host; the runner's lengths follow it on the device). A round's first
    step feeds every token the draft lacks (usually the bonus, after an all-accepted round
    also the last draft; more when earlier rounds did not use the model), as one [B, T]
    step whose padding writes past each row's length; steps 2..K feed d_1..d_{K-1}. After
    the verdict (n accepted of the model's drafts) a row keeps L + min(n, K-1) tokens, L
    being its length before the round; a row whose verified drafts came from elsewhere keeps L.
    With `guides` (grammar.guide.Guides) a constrained row's drafts are drawn from the
    draft's distribution masked by its grammar (q is that masked distribution), walking the
    matcher verification then reuses; the proposal then carries the drafts as host lists
    (the matcher needed them), so verification reads nothing more. `drafting`: the draft
    runner, K, the sampling settings (each row's, where rows sample differently) and the
    target's vocabulary (draft/decode.py's Drafting).
    Host waits: none of its own (inputs go up through staged uploads, core.hostsync); under a
    grammar, one read of each draft the matcher walks.
    """

    def __init__(self, drafting: Drafting, device, guides=None, audit: Audit | None = None) -> None:
        self.runner = drafting.runner  # backends.base.Runner of the draft model
        audit = audit or Audit()
        self.site = audit.site("draft")  # inputs of the draft model
        self.target_site = audit.site("target")  # n_draft where the target verifies
        self.guides = guides  # grammar.guide.Guides: constrained rows draft what their grammar allows
        self.k = drafting.k  # the most tokens a round may ask for
        self.params = drafting.params
        self.device = device  # where the target verifies
        self.decoder = DraftDecoder(drafting, self._generator())
        self.rows: Sequence[RowView] = ()
        self.cached: list[int] = []
        self._fed: list[int] = []  # per row: tokens the last propose left in the draft's cache
        self._k = 0  # drafts of the last propose
        self._shape: tuple[int, int] | None = None  # the cache `reserve` asked for, made at the first propose
        # the last propose's reading before it drafted: committed tokens fed (the most of any
        # row, the prompt's too on its first) and its marks on the draft's device (core.clock)
        self.clock = DeviceClock(self.runner.device)
        self._read: tuple[int, object, object] | None = None

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.runner.device).manual_seed(self.params.stream_seed(7919))

    def reserve(self, batch_size: int, num_slots: int) -> None:
        """The draft's KV cache for a batch (engine calls before start), with room for the
        padding of one catch-up chunk past any row's end. It is made when the drafter first
        proposes: K per round may never ask, and making it costs (a llama.cpp context of
        33k cells took 1.6 s here, which every first answer of a process waited for)."""
        self._shape = (batch_size, num_slots + CATCH_UP)
        self.decoder.generator = self._generator()

    def start(self, rows: Sequence[RowView], hidden=None) -> None:
        """A new batch; the draft reads its rows when it is first asked to propose (a
        drafter that never proposes costs nothing: K per round may never ask)."""
        self.rows = rows
        self.cached, self._fed = [], []

    def graph_report(self, since: dict | None = None) -> dict | None:
        """Drafter.graph_report: the draft model's runner's."""
        return self.runner.graph_report(since)

    def _prefill(self) -> None:
        """Every row's tokens except its last into the draft's cache, from the longest
        prefix of them its prefix cache holds."""
        if self._shape is not None:  # reserved, not made yet
            self.runner.reset(*self._shape)
            self._shape = None
        sequences = [row.tokens for row in self.rows]
        for b, seq in enumerate(sequences):
            self.runner.reuse(b, seq[:-1])
        self.runner.feed([self.runner.pending(b, seq[:-1]) for b, seq in enumerate(sequences)], Logits.NONE)
        self.runner.begin_steps()
        self.cached = [len(seq) - 1 for seq in sequences]
        self._fed = list(self.cached)

    @torch.inference_mode()
    def propose(self, active: Sequence[bool], k: int | None = None) -> Proposal:
        """K drafts per row (default: the drafter's K), every row batched."""
        k = self.k if k is None else k
        t0 = self.clock.mark()
        before = list(self.cached) or [0] * len(self.rows)
        if not self.cached:
            self._prefill()
        lengths = [row.length for row in self.rows]
        bound = max(lengths) + max(k, CATCH_UP)  # past every write of this round
        first = self._catch_up([row.tail(c) for row, c in zip(self.rows, self.cached)], bound)
        self._read = (max(n - c for n, c in zip(lengths, before)), t0, self.clock.mark())
        self.decoder.k = k
        if self.guides is not None:
            dev = self.runner.device
            self.decoder.allowed = lambda j, previous: self.guides.draft_allowed(j, previous, active, dev)
        drafted = self.decoder.decode(first, bound)
        self._fed = [n + k - 1 for n in lengths]
        self._k = k
        n_draft = self.target_site.upload([k if a else 0 for a in active], self.device)  # [B]
        q = None if drafted.q is None else drafted.q.to(self.device, non_blocking=True)  # [B, K, V] (device to device)
        tokens = None
        if self.guides is not None and k:  # the matcher walked d_1..d_K-1: read d_K too, before the target runs
            tokens = self.guides.drafted_tokens(drafted.tokens[:, -1], active, self.site)
        return Proposal(drafted.tokens.to(self.device, non_blocking=True), n_draft, q, tokens=tokens)  # [B, K]

    @property
    def last_read(self) -> tuple[int, float]:
        """The last propose's reading before it drafted: committed tokens fed (the most of
        any row) and the seconds the draft's device spent on it; ask after the round's
        read-back (on CUDA the marks are events, complete by then)."""
        if self._read is None:
            return (0, 0.0)
        fed, start, end = self._read
        return fed, self.clock.seconds(start, end)

    def _catch_up(self, pending: list[list[int]], bound: int) -> torch.Tensor:
        """Feed each row's committed tokens the draft lacks (>= 1: the bonus), in steps of
        at most CATCH_UP tokens; the draft's logits after each row's newest token [B, V_d].
        A row that ends in an earlier chunk keeps that chunk's logits: the first chunk's are
        copied out of the step's static buffer (graphs.py) when another chunk follows."""
        dev = self.runner.device
        first: torch.Tensor | None = None
        longest = max(map(len, pending))
        for start in range(0, longest, CATCH_UP):
            part = [p[start : start + CATCH_UP] for p in pending]
            width = max(map(len, part))
            host = [
                [max(len(x) - 1, 0), int(bool(x) and start + len(x) == len(p)), len(x)] + x + [0] * (width - len(x))
                for x, p in zip(part, pending)
            ]
            staged = self.site.upload(host, dev)  # [B, 3+T]: last, ends, fed, ids (one staged upload)
            ids = staged[:, 3:].contiguous()  # [B, T]
            logits = self.runner.step(ids, bound, at=staged[:, 0])  # [B, V_d]; padding may write past each row
            if first is None:  # a captured step's output is a static buffer: the next chunk rewrites it
                first = logits.clone() if start + CATCH_UP < longest else logits
            else:
                first = torch.where(staged[:, 1, None].bool(), logits, first)
            self.runner.advance(staged[:, 2])
        if first is None:  # every row lacks at least its bonus token
            raise ValueError("nothing to catch up on")
        return first

    def observe(self, outcome: RoundOutcome, adopted: Sequence[bool] | None = None) -> None:
        """Keep L + min(n, K-1) cached tokens per row whose verified drafts were this
        drafter's (`adopted`, default all), L for the others; idle rounds keep all."""
        if not self.cached:
            return  # never proposed: nothing cached to keep in step
        before = list(self.cached)
        for b, row in enumerate(self.rows):
            length = row.length - len(outcome.appended[b])  # L: the row before this round
            if self._fed[b] <= self.cached[b]:  # not proposed for this round
                continue
            kept = min(outcome.n_accepted[b], self._k - 1) if (adopted is None or adopted[b]) else 0
            self.cached[b] = max(length + kept, 0) if outcome.active[b] else self.cached[b]
        delta = [c - f if f > c0 else 0 for c, f, c0 in zip(self.cached, self._fed, before)]
        if any(delta):
            self.runner.advance(self.site.upload(delta, self.runner.device))
        self._fed = list(self.cached)

    def read_ahead(self, tokens, n: int) -> None:
        """Drafter.read_ahead: into the draft runner's prefix store (Runner.read_ahead)."""
        self.runner.read_ahead(tokens, n)

    def store_prefixes(self) -> None:
        """The draft's cache holds each row's first `cached` committed tokens."""
        for b, (row, n) in enumerate(zip(self.rows, self.cached)):
            self.runner.store(b, row.tokens[:n])

    def close(self) -> None:
        return None
