"""One seating of the batch: which rows sit in it and what their prompt read and rounds share.

`seat` makes it from the rows carried on from the last seating and the requests joining:
the joining requests become rows (core.sequence.Row.serving), the target's cache is reset
for the shape, the rows' grammar matchers and log-probabilities become the seating's
Shaper, their sampling settings its RowSampling, and the draft side builds its drafter (a
drafter that reads hidden states has the target keep them). The read of the prompts
(engine/prefill.py) and the rounds (engine/round.py) take the Seating whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ssdlocal.backends.base import Runner, SlotLayout
from ssdlocal.core.config import Mode, SpecConfig
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.sequence import Request, Row
from ssdlocal.draft.base import Drafter, DraftResources
from ssdlocal.engine.parts import EngineParts, Guard
from ssdlocal.engine.request import RowSampling
from ssdlocal.engine.shape import Shaper


@dataclass
class Seating:
    """The rows of one seating (carried rows first, in seat order) and what they share.

    `fresh[b]`: row b joined now (it reads its prompt and draws its first token) rather
    than carrying on from the last seating. `k`: drafts per round (0 for AR)."""

    rows: list[Row]
    fresh: list[bool]
    spec: SpecConfig
    k: int
    target: Runner
    guard: Guard
    sampling: RowSampling
    shaper: Shaper
    drafter: Drafter | None
    audit: Audit
    read: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # (first position, tokens) each row fed when seated

    @property
    def requests(self) -> list[Request]:
        return [row.request for row in self.rows if row.request is not None]


def seat(
    parts: EngineParts, carried: Sequence[Row], joining: Sequence[Request], spec: SpecConfig, generators: dict
) -> Seating:
    """The seating of `carried` rows and `joining` requests under `spec` (resolved);
    `generators`: the loop's random streams by sampling settings (kept across seatings)."""
    k = spec.k if spec.mode is not Mode.AR else 0
    budgets = [parts.limits.budgets([len(r.prompt)], r.params.max_new_tokens, spec)[0] for r in joining]
    new = [Row.serving(r, parts.eos_ids, parts.tokenizer, n) for r, n in zip(joining, budgets)]
    rows = [*carried, *new]
    num_slots = SlotLayout.for_generation(max(len(r.prompt) + r.max_new_tokens for r in rows), k).main
    parts.target.reset(len(rows), num_slots)
    shaper = Shaper.for_rows(rows, parts.vocab_size, parts.eos_ids, parts.audit)
    sampling = RowSampling([r.request for r in rows if r.request is not None], parts.target.device, generators)
    offered = DraftResources(
        parts.vocab_size,
        parts.target.device,
        len(rows),
        num_slots,
        memory=parts.suffix.memory,
        costs=parts.costs,
        rates=parts.rates,
        guides=shaper.guides,
        row_params=sampling.row_params,
        hidden_size=parts.hidden_size,
        target=parts.target,
    )
    drafter = parts.drafts.make_drafter(spec, sampling.params, offered)
    parts.target.keep_hidden(drafter.hidden if drafter is not None else None)
    fresh = [False] * len(carried) + [True] * len(new)
    return Seating(rows, fresh, spec, k, parts.target, parts.guard, sampling, shaper, drafter, parts.audit)
