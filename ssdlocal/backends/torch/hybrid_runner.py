"""The torch runner of a hybrid model (linear-attention layers beside attention: models/hybrid.py).

The Runner protocol (backends/base.py) assumes a row's cache can be cut back to any earlier
token by moving its length. A linear layer's state cannot be cut back, so the model keeps a
row's states by position (backends/torch/linear_states.py: slot p % R holds the state after
position p) and this runner keeps that true:

- steps (decode, verify) write the state after every position they feed, so `advance(n)`
  alone selects each row's state after its last accepted token, on the device;
- before a step could overwrite a position a row may still go back to, the ring grows
  (`spanned`: positions written since the last point no row goes back past: an `advance`
  with host counts (the engine's rounds), a `step(at=)` (a draft's catch-up) or
  `begin_steps`);
- short feeds write every position too; a long feed (as many tokens as the ring, or more)
  runs the chunked form and keeps only the state after each row's last token;
- the host knows which positions each row's ring holds (LinearStates.host) wherever it knows
  the positions written; a feed first re-reads a row from the last position whose state it
  holds when its current one is not there (after `sync` cut into a long feed, an adopted
  tree branch, a failed feed): exact, at the price of the tokens read again;
- SSD tree steps carry one state per branch (LinearStates' tree buffers, the fork's state
  from the ring at the first step); `take_branch` copies the branch's last state to the
  row's ring (the branch's earlier positions are not kept: a later cut into them re-reads).
- the prefix store (stored_states.py) keeps the state at a stored sequence's last block
  end; a long feed is read in two parts, up to each row's last block end and the rest, so
  the state at that block end is written even when no step follows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ssdlocal.backends.base import Logits, kept_logits
from ssdlocal.backends.prefix import BLOCK_TOKENS
from ssdlocal.backends.torch.linear_states import LinearStates
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.kvcache import rounded_slots
from ssdlocal.backends.torch.runner import FIRST_CAPACITY, TorchRunner
from ssdlocal.backends.torch.stored_states import StoredStates
from ssdlocal.core.config import GraphMode

RING_STEP = 4  # rings grow in multiples of this many positions


class HybridRunner(StoredStates, TorchRunner):
    """TorchRunner over a HybridLM: its linear layers' states follow every row."""

    def __init__(self, loaded: LoadedModel, *, graphs: GraphMode = GraphMode.AUTO) -> None:
        super().__init__(loaded, graphs=graphs)
        self.spanned = 0  # positions steps may have written past a row's floor (see module doc)
        self.begun: list[int] = []  # each row's length at begin_steps
        self.begun_ends = 0  # LinearStates.ends at begin_steps
        self.stepped = 0  # positions stepped since begin_steps (an upper bound per row)
        self.tree_depth = 0  # tree steps since the last feed
        self.tree_first: Tensor | None = None  # [B, W] the slots of the tree's first step
        self._inner = False  # inside this runner's own feed

    def warm_up(self, batch_size: int, widths: Sequence[int], at_widths: Sequence[int] = ()) -> int:
        """Runner.warm_up: nothing (a cache of exactly the batch's rows: graphs are captured
        when a batch size is first reached)."""
        return 0

    @property
    def states(self) -> LinearStates:
        assert self.model.linear_states is not None  # reset ran
        return self.model.linear_states

    def reset(self, batch_size: int, num_slots: int) -> None:
        """TorchRunner.reset, with a cache of exactly `batch_size` rows: the linear layers'
        states hold one per row and every step runs on all of them (no padded rows)."""
        if batch_size != self.rows:
            first = min(num_slots, FIRST_CAPACITY) if self.plain else num_slots
            self._allocate(batch_size, rounded_slots(first))
        super().reset(batch_size, num_slots)
        self.model.forget_states()
        self.spanned, self.stepped, self.tree_depth, self.tree_first = 0, 0, 0, None

    # ------------------------------------------------------------------ feeds
    @torch.inference_mode()
    def feed(self, rows: Sequence[Sequence[int]], logits: Logits = Logits.ALL, progress=None) -> list[Tensor]:
        """Runner.feed; a row whose state after its last held token is not in its ring is
        read again from the last position whose state is (those logits are dropped)."""
        if self._inner:
            return super().feed(rows, logits, progress)
        logits = Logits.of(logits)
        self.tree_depth = 0
        asked = [len(r) for r in rows]
        again = [self._known_prefix(b) for b in range(len(rows))]  # tokens read again per row
        rows = [list(self.held[b][len(self.held[b]) - n :]) + list(r) for b, (n, r) in enumerate(zip(again, rows))]
        for b, n in enumerate(again):
            if n:
                del self.held[b][len(self.held[b]) - n :]
        out = self._feed(rows, logits, progress)
        if any(again) and self._hidden is not None:  # the hidden states of the asked tokens only
            self._hidden = joined(self._hidden[:, :0], self._hidden, [-n for n in again], [len(r) for r in rows])
        if logits is Logits.ALL:
            return [o[n:] for o, n in zip(out, again)]
        return [o if n else o[:0] for o, n in zip(out, asked)]

    def _known_prefix(self, row: int) -> int:
        """How many of row `row`'s last held tokens must be read again: 0 when the state
        after its last one is in its ring."""
        n = len(self.held[row])
        m = n
        while m > 0 and not self.states.knows(row, m - 1):
            m -= 1
        return n - m

    def _feed(self, rows: list[list[int]], logits: Logits, progress) -> list[Tensor]:
        states, width = self.states, max(map(len, rows))
        starts = [len(h) for h in self.held]
        cuts = [(s + len(r)) // BLOCK_TOKENS * BLOCK_TOKENS - s for s, r in zip(starts, rows)]
        if self.prefix is not None and width >= self.model.ring and any(0 < c < len(r) for c, r in zip(cuts, rows)):
            return self._feed_to_block_ends(rows, [max(c, 0) for c in cuts], logits, progress)
        for b, start in enumerate(starts):
            states.truncated(b, start)
        short = width < self.model.ring  # every position's state fits the ring: written
        ends = None if short or not width else [s + len(r) for s, r in zip(starts, rows)]
        self._inner = True
        try:
            with self.model.context(ends=ends):
                out = super().feed(rows, logits, progress)
        except BaseException:
            for b, (start, r) in enumerate(zip(starts, rows)):
                states.wrote(b, range(start, start + width), start)  # none of it is known now
                if r:
                    states.host[b][(start + len(r) - 1) % states.ring] = -1  # a long feed's last write
            raise
        finally:
            self._inner = False
        for b, (start, r) in enumerate(zip(starts, rows)):
            if short:
                states.wrote(b, range(start, start + width), start + len(r))
            elif r:
                states.wrote_final(b, start + len(r) - 1)
        return out

    def _feed_to_block_ends(self, rows: list[list[int]], cuts: list[int], logits: Logits, progress) -> list[Tensor]:
        """A long feed in two: each row up to its last block end (`cuts`: its tokens
        before it), then the rest; the logits asked for, as one feed gives them."""
        head = self._feed(
            [r[:c] for r, c in zip(rows, cuts)], Logits.NONE if logits is Logits.NONE else logits, progress
        )
        first = self._hidden
        tail = self._feed([r[c:] for r, c in zip(rows, cuts)], logits, None)
        if first is not None and self._hidden is not None:  # the hidden states of both parts, per row
            self._hidden = joined(first, self._hidden, cuts, [len(r) for r in rows])
        if logits is Logits.ALL:
            return [torch.cat([h, t]) for h, t in zip(head, tail)]
        return [t if len(r) > c else h for h, t, r, c in zip(head, tail, rows, cuts)]

    # ------------------------------------------------------------------ steps
    def begin_steps(self) -> None:
        if any(self._known_prefix(b) for b in range(len(self.held))):
            self.feed([[] for _ in self.held], Logits.NONE)  # read again what the rings lost
        super().begin_steps()
        self.begun = [len(h) for h in self.held]
        self.begun_ends = self.states.ends  # block-end entries then (stored_states.py)
        self.spanned = self.stepped = 0

    @torch.inference_mode()
    def step(self, ids: Tensor, bound: int | None = None, at: Tensor | None = None) -> Tensor:
        """TorchRunner.step, after growing the rings when this step could overwrite the
        state of a position a row may still go back to."""
        width = ids.shape[1]
        if self.spanned + width + 1 > self.model.ring:
            self._grow_ring(self.spanned + width + 1)
        out = super().step(ids, bound, at)
        self.spanned = width if at is not None else self.spanned + width
        self.stepped += width
        return out

    @torch.inference_mode()
    def advance(self, n: Tensor | int, host: Sequence[int] | None = None) -> None:
        super().advance(n, host)
        if host is not None:  # the engine's rounds: no row goes back past these lengths
            self.spanned = 0

    def end_steps(self, kept: Mapping[int, Sequence[int]]) -> None:
        """Runner.end_steps; the host learns which stepped positions hold kept tokens."""
        for b, begun in enumerate(self.begun[: len(self.held)]):
            self.states.wrote(b, range(begun, begun + self.stepped), begun + len(kept.get(b, ())))
        super().end_steps(kept)

    def _grow_ring(self, need: int) -> None:
        self.model.grow_ring(-(-need // RING_STEP) * RING_STEP)
        self._graphs_invalid()  # they hold the old rings

    # ------------------------------------------------------------------ trees (SSD)
    @torch.inference_mode()
    def forward_raw(
        self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, out: Tensor | None = None
    ) -> Tensor:
        """TorchRunner.forward_raw (with its `out`) with a state per branch: the first tree
        step after a feed starts every branch from its fork's state in the ring, later ones
        from the tree buffers (read one, write the other: a graph per parity)."""
        if not self.plain:
            raise RuntimeError(
                "tree steps of a tensor-parallel hybrid model are not implemented"
            )  # no caller makes them
        depth = self.tree_depth
        if depth == 0:
            self._tree_buffers(ids.shape[1])
            self.tree_first = slots.clone()
        self._ensure(mask.shape[-1])
        with self.model.context(tree=depth):
            if self.graphs is not None:
                key = ("tree", depth == 0, depth % 2, *mask.shape)
                inputs = dict(input_ids=ids, positions=positions, slots=slots, attn_mask=mask)
                logits = self.graphs.run(key, self.model, **inputs)  # a static buffer
                result = logits.clone() if out is None else kept_logits(logits, out)
            else:
                result = kept_logits(self.model(ids, positions, slots, mask), out)  # [B, W, V]
        self.tree_depth += 1
        return result

    def _tree_buffers(self, width: int) -> None:
        states = self.states
        before = states.tree_rec[0][0] if states.tree_rec else None
        states.tree_width(width)
        if states.tree_rec[0][0] is not before:
            self._graphs_invalid()  # they hold the old buffers

    @torch.inference_mode()
    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """TorchRunner.take_branch; the branch's state after its last slot becomes the row's
        after position start + len(src) - 1 (found on the device by the branch's first slot)."""
        super().take_branch(row, src, start, tokens)
        self.states.truncated(row, start)
        if not src:
            return
        if len(src) != self.tree_depth or self.tree_first is None:
            raise RuntimeError(f"a branch of {len(src)} steps taken after {self.tree_depth} tree steps")
        column = (self.tree_first[row] == src[0]).int().argmax().reshape(1)  # [1] on the device
        self.states.adopt(row, len(src), column, start + len(src) - 1)


def joined(first: Tensor, second: Tensor, cuts: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """Per row b, the first cuts[b] columns of `first` [B, T1, D] then the columns of `second`
    [B, T2, D] up to lengths[b] in all (a negative cut: second's first -cuts[b] columns are
    dropped), left-aligned and zero-padded -> [B, max(lengths), D]."""
    out = second.new_zeros(second.shape[0], max(lengths, default=0), second.shape[2])
    for b, (c, n) in enumerate(zip(cuts, lengths)):
        if c >= 0:
            out[b, :c] = first[b, :c]
            out[b, c:n] = second[b, : n - c]
        else:
            out[b, : n + c] = second[b, -c:n]
    return out
