"""The per-row states of a model's linear-attention layers, beside its KV cache.

A linear-attention layer (models/deltanet.py) carries a convolution window (its last K-1
inputs) and a recurrent state per value head instead of keys and values, and a state cannot
be cut back to an earlier token the way a KV cache's write position can. So a row's states
are kept *by position* in a ring: slot p % R holds the recurrent state after position p
(float32, as transformers keeps it) and slot p % Rc the convolution's input at p. A step of
T tokens writes the state after each of them; the next step reads the state after its
row's length - 1. Moving a row's length (Runner.advance: 1 + accepted) therefore selects
the state after its last accepted token, on the device, with no copy and no host read;
rejected positions are written again later, like a KV cache's slots. A ring holds the last
R positions written: the runner grows it (`grow`) before a step could overwrite a position
a row may still return to (hybrid_runner.py says when). Slot R (and Rc) is a trash slot for
writes that go nowhere.

Every ring write also writes the position into `tags` [B, R+1] (device), and the host keeps
the same per-row map for writes it knows the positions of (`host`): feeds, adopted tree
branches, loads. SSD's tree steps keep one state per branch in two buffers (read one, write
the other, so re-running a step, as a graph capture does, gives the same result).
All tensors here are read and written in place: captured steps hold their addresses.
Knows nothing about runners or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class LinearContext:
    """How a forward's linear-attention layers run (deltanet.py), set around one call and
    never inside a captured step's Python: `ends` [B] (a long feed: each row's end
    position) with `carry` (each layer's state between the chunks of that feed), `tree` (a
    tree step's depth: 0 reads the fork's state from the ring) with `positions` [B, W] (the
    tree queries' positions)."""

    ends: Tensor | None = None
    tree: int | None = None
    positions: Tensor | None = None
    carry: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class LinearStates(nn.Module):
    """States of `shapes` linear layers (per layer: channels C, value heads H, Dk, Dv) for
    `batch` rows, in rings of `ring` positions; K the convolution's kernel. Its tensors are
    buffers (not saved), so a model that holds it lists them among its own."""

    def __init__(
        self, batch: int, shapes: list[tuple[int, int, int, int]], ring: int, kernel: int, dtype, device
    ) -> None:
        super().__init__()
        self.batch, self.shapes, self.kernel, self.dtype = batch, shapes, kernel, dtype
        self.device = torch.device(device)
        self.ring = ring  # R
        self.conv_ring = ring + kernel - 2  # Rc: the K-2 inputs before the oldest state's position
        self.rec = [torch.zeros(batch, ring + 1, h, dk, dv, device=device) for _, h, dk, dv in shapes]
        self.conv = [torch.zeros(batch, self.conv_ring + 1, c, dtype=dtype, device=device) for c, *_ in shapes]
        self.tags = torch.full((batch, ring + 1), -1, dtype=torch.long, device=device)
        for i, (rec, conv) in enumerate(zip(self.rec, self.conv)):
            self.register_buffer(f"rec_{i}", rec, persistent=False)
            self.register_buffer(f"conv_{i}", conv, persistent=False)
        self.register_buffer("tags_", self.tags, persistent=False)
        self.host: list[list[int]] = [[-1] * ring for _ in range(batch)]  # per row: the position each slot holds
        self.tree_rec: list[list[Tensor]] = []  # per layer two [B, W, H, Dk, Dv] buffers (tree steps)
        self.tree_conv: list[list[Tensor]] = []  # per layer two [B, W, K-1, C]

    @staticmethod
    def bytes_for(batch: int, shapes: list[tuple[int, int, int, int]], ring: int, kernel: int, dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        rec = sum(h * dk * dv * 4 for _, h, dk, dv in shapes) * (ring + 1)
        conv = sum(c * size for c, *_ in shapes) * (ring + kernel - 1)
        return batch * (rec + conv + 8 * (ring + 1))

    @staticmethod
    def state_bytes(shapes: list[tuple[int, int, int, int]], kernel: int, dtype) -> int:
        """One row's state after one position, every layer: what a verify writes per token."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(h * dk * dv * 4 + c * size * (kernel - 1) for c, h, dk, dv in shapes)

    @property
    def nbytes(self) -> int:
        buffers = [*self.rec, *self.conv, self.tags, *(t for pair in (*self.tree_rec, *self.tree_conv) for t in pair)]
        return sum(t.nbytes for t in buffers)

    def tensors(self) -> tuple[Tensor, ...]:
        """What captured steps read and write (the runner's graph guard compares them)."""
        pairs = (t for pair in (*self.tree_rec, *self.tree_conv) for t in pair)
        return (*self.rec, *self.conv, self.tags, *pairs)

    # ------------------------------------------------------------------ rings
    def _slots(self, positions: Tensor, size: int) -> Tensor:
        """Ring slots of `positions` (any shape); negative positions go to the trash slot."""
        return torch.where(positions >= 0, positions % size, size)

    def read(self, layer: int, before: Tensor) -> tuple[Tensor, Tensor]:
        """The state after position `before` [B] (or [B, W]; -1: a row's start, zeros):
        (the K-1 convolution inputs up to it [..., K-1, C], the recurrent state [..., H, Dk, Dv])."""
        lead = before.shape
        rows = torch.arange(self.batch, device=before.device).reshape(-1, *([1] * (len(lead) - 1)))  # [B, 1..]
        back = torch.arange(self.kernel - 2, -1, -1, device=before.device)  # [K-1]: K-2 .. 0
        at = before[..., None] - back  # [..., K-1] positions of the window
        window = self.conv[layer][rows[..., None], self._slots(at, self.conv_ring)]  # [..., K-1, C]
        window = window.masked_fill((at < 0)[..., None], 0.0)
        state = self.rec[layer][rows, self._slots(before, self.ring)]  # [..., H, Dk, Dv]
        return window, state.masked_fill((before < 0).reshape(*lead, 1, 1, 1), 0.0)

    def write(self, layer: int, positions: Tensor, inputs: Tensor, states: Tensor) -> None:
        """Per position: inputs [B, T, C] and the state after each [B, T, H, Dk, Dv] at
        `positions` [B, T]."""
        rows = torch.arange(self.batch, device=positions.device)[:, None]  # [B, 1]
        self.conv[layer][rows, self._slots(positions, self.conv_ring)] = inputs
        slots = self._slots(positions, self.ring)  # [B, T]
        self.rec[layer][rows, slots] = states
        if layer == 0:
            self.tags[rows, slots] = positions

    def write_final(self, layer: int, last: Tensor, window: Tensor, state: Tensor) -> None:
        """The state after position `last` [B] (-1: nothing to write for that row): its
        window [B, K-1, C] (inputs at last-K+2 .. last; negative positions go to the trash)
        and recurrent state [B, H, Dk, Dv]."""
        rows = torch.arange(self.batch, device=last.device)
        back = torch.arange(self.kernel - 2, -1, -1, device=last.device)  # [K-1]
        at = (last[:, None] - back).masked_fill(last[:, None] < 0, -1)  # [B, K-1]
        self.conv[layer][rows[:, None], self._slots(at, self.conv_ring)] = window
        slot = self._slots(last, self.ring)  # [B]
        self.rec[layer][rows, slot] = state
        if layer == 0:
            self.tags[rows, slot] = last

    # ------------------------------------------------------------------ tree steps
    def tree_width(self, width: int) -> None:
        """Tree buffers for `width` branches per row (allocated once per width)."""
        if self.tree_rec and self.tree_rec[0][0].shape[1] >= width:
            return
        self.tree_rec = [
            [torch.zeros(self.batch, width, h, dk, dv, device=self.device) for _ in range(2)]
            for _, h, dk, dv in self.shapes
        ]
        self.tree_conv = [
            [torch.zeros(self.batch, width, self.kernel - 1, c, dtype=self.dtype, device=self.device) for _ in range(2)]
            for c, *_ in self.shapes
        ]
        for i, (recs, convs) in enumerate(zip(self.tree_rec, self.tree_conv)):
            for j in range(2):
                self.register_buffer(f"tree_rec_{i}_{j}", recs[j], persistent=False)
                self.register_buffer(f"tree_conv_{i}_{j}", convs[j], persistent=False)

    def tree_read(self, layer: int, depth: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Branch states before tree step `depth` for queries at `positions` [B, W]."""
        if depth == 0:
            return self.read(layer, positions - 1)  # the fork: the row's state before the branch
        W = positions.shape[1]
        return self.tree_conv[layer][depth % 2][:, :W], self.tree_rec[layer][depth % 2][:, :W]

    def tree_write(self, layer: int, depth: int, window: Tensor, state: Tensor) -> None:
        """Branch states after tree step `depth` (into the buffer the next step reads)."""
        W = window.shape[1]
        self.tree_conv[layer][(depth + 1) % 2][:, :W].copy_(window)
        self.tree_rec[layer][(depth + 1) % 2][:, :W].copy_(state)

    def adopt(self, row: int, depth: int, branch: Tensor, last: int) -> None:
        """Row `row` takes branch `branch` ([] long: its column, on the device) of a tree
        that ran `depth` steps: the branch's state becomes the row's after position `last`."""
        back = torch.arange(self.kernel - 2, -1, -1, device=self.device)  # [K-1]
        at = last - back  # [K-1]
        conv_slots = self._slots(at, self.conv_ring)
        for layer in range(len(self.shapes)):
            window = self.tree_conv[layer][depth % 2][row].index_select(0, branch)[0]  # [K-1, C]
            self.conv[layer][row, conv_slots] = window
            self.rec[layer][row, last % self.ring] = self.tree_rec[layer][depth % 2][row].index_select(0, branch)[0]
        self.tags[row, last % self.ring] = last
        self.host[row][last % self.ring] = last

    # ------------------------------------------------------------------ bookkeeping
    def knows(self, row: int, position: int) -> bool:
        """Whether the host knows the state after `position` is in row `row`'s ring (-1: the
        start, always)."""
        return position < 0 or self.host[row][position % self.ring] == position

    def truncated(self, row: int, length: int) -> None:
        """Row `row`'s tokens from position `length` on are no longer the ones its ring's
        states were computed for (cut, replaced): the host forgets those states."""
        self.host[row] = [p if p < length else -1 for p in self.host[row]]

    def wrote(self, row: int, positions: range, valid: int) -> None:
        """The host's map after writes at `positions` of row `row`: those below `valid`
        hold the row's states, the rest garbage (padding, rejected tokens)."""
        for p in positions:
            self.host[row][p % self.ring] = p if p < valid else -1

    def forget(self) -> None:
        """No row holds anything (a reset)."""
        self.host = [[-1] * self.ring for _ in range(self.batch)]
        self.tags.fill_(-1)

    def grown(self, ring: int) -> LinearStates:
        """A copy with rings of `ring` positions, every position this one holds in place
        (moved by the device tags: no host read)."""
        bigger = LinearStates(self.batch, self.shapes, ring, self.kernel, self.dtype, self.device)
        rows = torch.arange(self.batch, device=self.device)[:, None]
        held = self.tags[:, : self.ring]  # [B, R]
        slots = bigger._slots(held, ring)  # [B, R]: -1 tags go to the trash
        for old, new in zip(self.rec, bigger.rec):
            new[rows, slots] = old[:, : self.ring]
        # a convolution input at p sits at p % Rc: move the K-1 before each held state with it
        back = torch.arange(self.kernel - 2, -1, -1, device=self.device)  # [K-1]
        at = held[..., None] - back  # [B, R, K-1]
        src = self._slots(at.masked_fill(held[..., None] < 0, -1), self.conv_ring).reshape(self.batch, -1)
        dst = bigger._slots(at.masked_fill(held[..., None] < 0, -1), bigger.conv_ring).reshape(self.batch, -1)
        for old, new in zip(self.conv, bigger.conv):
            new[rows, dst] = old[rows, src]
        bigger.tags[rows, slots] = held
        bigger.tags[:, ring] = -1
        if self.tree_rec:
            bigger.tree_width(self.tree_rec[0][0].shape[1])
            for mine, theirs in zip((*self.tree_rec, *self.tree_conv), (*bigger.tree_rec, *bigger.tree_conv)):
                for a, b in zip(mine, theirs):
                    b.copy_(a)
        for b, tags in enumerate(self.host):
            for p in tags:
                if p >= 0:
                    bigger.host[b][p % ring] = p
        return bigger
