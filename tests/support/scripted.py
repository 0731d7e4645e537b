"""A scripted Runner: the backends.base.Runner protocol over a table instead of a model.

A row's logits at a position are `logits_of(tokens)` [V], `tokens` being what the row's
cache holds up to and including that position, so a test states the "model" as a function
(`follow(table)`: the next token is a function of the tokens so far). The runner keeps each
row's cache as the token written to every slot, and refuses what a real runner would
silently get wrong: a step written past the cache, a stored prefix or an `end_steps` claim
the slots do not hold, a tree query whose visible slots disagree with its position. Every
call is counted in `calls` and every step's width and `bound` kept in `steps`, so tests of
the round, the prefill and the drafters run in milliseconds and see what was asked for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ssdlocal.backends.base import HeldRows, kept_logits
from ssdlocal.draft.base import DrafterBase

LogitsOf = Callable[[Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class StepCall:
    """One `step`: its width T, the `bound` it was given and each row's length before it."""

    width: int
    bound: int | None
    lengths: tuple[int, ...]

    def bound_covers(self, rows) -> bool:
        """Whether `bound` reaches past every write of rows `rows` (attention spans are cut there)."""
        return self.bound is None or all(self.bound >= self.lengths[b] + self.width for b in rows)


def follow(next_token: Callable[[Sequence[int]], int], vocab_size: int, height: float = 6.0) -> LogitsOf:
    """Logits peaked at `next_token(tokens)` (`height` above every other token, all of
    which are 0): greedy decoding follows the table; sampling at temperature 1 draws it
    with probability e^height / (e^height + V - 1)."""

    def logits_of(tokens: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(vocab_size)
        out[next_token(tokens) % vocab_size] = height
        return out

    return logits_of


class ScriptedRunner(HeldRows):
    """A Runner whose logits come from `logits_of`; prefix blocks of `block` tokens; long
    feeds in chunks of `chunk` tokens per row (progress is reported after each)."""

    def __init__(self, logits_of: LogitsOf, vocab_size: int, chunk: int = 8, block: int = 4) -> None:
        self.logits_of = logits_of
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.chunk, self.block = chunk, block
        self.num_slots = 0
        self.held: list[list[int]] = []
        self.slots: list[list[int | None]] = []  # per row: the token whose k/v each slot holds
        self.lengths: list[int] = []  # per row, in step mode
        self.stored: list[tuple[int, ...]] = []
        self.prefix_capacity = 0
        self.calls: Counter[str] = Counter()
        self.steps: list[StepCall] = []  # every `step`, in order
        self._begun: list[list[int]] = []

    # ------------------------------------------------------------------ rows
    def reset(self, batch_size: int, num_slots: int) -> None:
        self.calls["reset"] += 1
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self.slots = [[None] * num_slots for _ in range(batch_size)]
        self.lengths = [0] * batch_size
        self._count_end()

    def _write(self, row: int, position: int, token: int) -> None:
        if not 0 <= position < self.num_slots:
            raise IndexError(f"row {row}: slot {position} outside the cache's {self.num_slots}")
        self.slots[row][position] = int(token)

    def _logits_at(self, row: int, position: int) -> torch.Tensor:
        seen = self.slots[row][: position + 1]
        if None in seen:
            raise ValueError(f"row {row}: position {position} attends to an unwritten slot")
        return self.logits_of(seen).float()

    def feed(self, rows: Sequence[Sequence[int]], logits: str = "all", progress=None) -> list[torch.Tensor]:
        self.calls["feed"] += 1
        before = [list(h) for h in self.held]
        out: list[list[torch.Tensor]] = [[] for _ in rows]
        total = max(map(len, rows), default=0)
        try:
            for start in range(0, total, self.chunk):
                for b, tokens in enumerate(rows):
                    for token in tokens[start : start + self.chunk]:
                        self._write(b, len(self.held[b]), token)
                        self.held[b].append(int(token))
                        if logits == "all" or (logits == "last" and len(self.held[b]) == len(before[b]) + len(tokens)):
                            out[b].append(self._logits_at(b, len(self.held[b]) - 1))
                if progress is not None:
                    progress(min(start + self.chunk, total), total)
        except BaseException:
            self.held = before
            raise
        empty = torch.zeros(0, self.vocab_size)
        return [torch.stack(o) if o else empty for o in out]

    # ------------------------------------------------------------------ prefix store
    def setup_prefix(self, tokens: int) -> int:
        self.prefix_capacity, self.stored = tokens, []
        return tokens

    def reuse(self, row: int, tokens: Sequence[int]) -> int:
        if self.held[row]:
            return 0
        best = max((self._common(s, tokens) for s in self.stored), default=0)
        n = best - best % self.block
        for i, token in enumerate(tokens[:n]):
            self._write(row, i, token)
        self.held[row] = list(tokens[:n])
        return n

    @staticmethod
    def _common(a: Sequence[int], b: Sequence[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def store(self, row: int, tokens: Sequence[int]) -> None:
        if list(self.slots[row][: len(tokens)]) != list(tokens):
            raise ValueError(f"row {row}: asked to store tokens its slots do not hold")
        if self.prefix_capacity:
            self.stored.append(tuple(tokens))

    # ------------------------------------------------------------------ steps
    def begin_steps(self) -> None:
        self.calls["begin_steps"] += 1
        self.lengths = [len(h) for h in self.held]
        self._begun = [list(h) for h in self.held]
        self._count_begin()

    def step(self, ids: torch.Tensor, bound: int | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
        if at is not None:  # every column is written, as the torch runner does
            return self.step(ids, bound)[torch.arange(ids.shape[0]), at]
        self.calls["step"] += 1
        batch, width = ids.shape
        self.steps.append(StepCall(width, bound, tuple(self.lengths)))
        host = ids.tolist()
        for b in range(batch):
            for t in range(width):
                self._write(b, self.lengths[b] + t, host[b][t])
        return torch.stack(
            [torch.stack([self._logits_at(b, self.lengths[b] + t) for t in range(width)]) for b in range(batch)]
        )

    def advance(self, n, host=None) -> None:
        steps = n.tolist() if isinstance(n, torch.Tensor) else [int(n)] * len(self.lengths)
        if host is not None and list(map(int, host)) != steps:
            raise ValueError(f"advance: host counts {list(host)} are not the device's {steps}")
        self.lengths = [length + int(s) for length, s in zip(self.lengths, steps)]
        self._count_advance(n, host)

    def end_steps(self, kept: Mapping[int, Sequence[int]]) -> None:
        self.calls["end_steps"] += 1
        for b, begun in enumerate(self._begun):
            extra = list(kept.get(b, ()))
            if self.slots[b][len(begun) : len(begun) + len(extra)] != extra:
                raise ValueError(f"row {b}: end_steps keeps tokens its slots do not hold")
            self.held[b] = begun + extra
        self._count_end()

    def cache_holds(self, row: int, tokens: Sequence[int]) -> bool:
        """Whether row `row`'s first len(tokens) slots hold exactly `tokens` (step mode)."""
        return self.slots[row][: len(tokens)] == list(tokens)

    # ------------------------------------------------------------------ trees
    def forward_raw(self, ids, positions, slots, mask, out=None) -> torch.Tensor:
        self.calls["forward_raw"] += 1
        batch, width = ids.shape
        for b in range(batch):
            for t in range(width):
                self._write(b, int(slots[b, t]), int(ids[b, t]))
        found = torch.empty(batch, width, self.vocab_size)
        for b in range(batch):
            for t in range(width):
                seen = [self.slots[b][s] for s in range(mask.shape[-1]) if mask[b, t, s]]
                if None in seen or len(seen) != int(positions[b, t]) + 1:
                    raise ValueError(f"row {b}, query {t}: sees {len(seen)} slots at position {int(positions[b, t])}")
                found[b, t] = self.logits_of(seen).float()
        return kept_logits(found, out)

    def tree_width(self, width: int) -> int:
        return width

    def warm_up(self, batch_size: int, widths, at_widths=()) -> int:
        return 0  # nothing captured

    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        if [self.slots[row][s] for s in src] != list(tokens):
            raise ValueError(f"row {row}: the branch's slots do not hold {list(tokens)}")
        for i, token in enumerate(tokens):
            self._write(row, start + i, token)
        del self.held[row][start:]
        self.held[row].extend(tokens)


class TableDrafter(DrafterBase):
    """A Drafter (draft.base) proposing `k` tokens per active row from `next_token` (a
    table like the runner's, usually wrong somewhere), as host lists; it records every
    RoundOutcome it is told, so tests see what the round reported."""

    def __init__(self, next_token: Callable[[Sequence[int]], int], k: int) -> None:
        self.next_token, self.k = next_token, k
        self.rows: Sequence = ()
        self.outcomes: list = []

    def start(self, rows, hidden=None) -> None:
        self.rows = rows

    def propose(self, active: Sequence[bool]):
        from ssdlocal.draft.base import Proposal

        tokens = []
        for row, on in zip(self.rows, active):
            drafts: list[int] = []
            while on and len(drafts) < self.k:
                drafts.append(self.next_token(row.tokens + drafts))
            tokens.append(drafts)
        return Proposal.from_lists(tokens, self.k, "cpu")

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)


class Names:
    """A tokenizer for Rows (core.sequence): token i decodes to "<i>"."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def seating_of(runner, rows, sampling, drafter=None, k: int = 0, *, shaper=None, audit=None, fresh=None):
    """An engine.seating.Seating of `rows` on `runner` (the guard runs a call as it is; no
    grammar or log-probabilities unless `shaper`; every row fresh unless `fresh`)."""
    from ssdlocal.core.config import Mode, NgramDraft, SpecConfig
    from ssdlocal.core.hostsync import Audit
    from ssdlocal.engine.seating import Seating
    from ssdlocal.engine.shape import Shaper

    audit = audit or Audit()
    spec = SpecConfig(mode=Mode.SD, k=k, draft=NgramDraft()) if k else SpecConfig()
    fresh = list(fresh) if fresh is not None else [True] * len(rows)
    guard = lambda fn, *a: fn(*a)  # noqa: E731
    return Seating(list(rows), fresh, spec, k, runner, guard, sampling, shaper or Shaper(audit=audit), drafter, audit)


def sampling_of(params, rows: int, device="cpu"):
    """engine.request.RowSampling of `rows` rows that all sample with `params` (one group,
    its generator seeded with params.seed): what a generate call's rounds use."""
    from ssdlocal.engine.request import RowSampling
    from ssdlocal.core.sequence import Request

    return RowSampling([Request((0,), params) for _ in range(rows)], device)
