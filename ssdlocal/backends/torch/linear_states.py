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
R positions written: the runner grows it (`grown`) before a step could overwrite a position
a row may still return to (hybrid_runner.py says when).

Block ends (positions 16m + 15, the prefix store's blocks: backends/prefix.py) are also kept
in a second, smaller ring by block (`blocks`: entry m % Cb), so a state at a block end
survives the R positions after it for the prefix store. Slots R, Rc and Cb are trash slots
for writes that go nowhere. Every write also writes the position into device tags, and the
host keeps the same map for writes whose positions it knows (`host`, `block_host`): feeds,
steps once `end_steps` says which tokens they held, adopted tree branches, loads.
SSD's tree steps keep one state per branch in two buffers (read one, write the other, so
re-running a step, as a graph capture does, gives the same result). All tensors are
buffers read and written in place: captured steps hold their addresses. Knows nothing
about runners or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ssdlocal.backends.prefix import BLOCK_TOKENS


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


Shapes = list[tuple[int, int, int, int]]  # per linear layer: channels C, value heads H, Dk, Dv


def block_entries(ring: int) -> int:
    """Block-end entries a ring of `ring` positions needs: a step writes at most `ring`
    positions past a row's length, so at most that many block ends past its newest one."""
    return 2 + ring // BLOCK_TOKENS


class LinearStates(nn.Module):
    """States of linear layers of `shapes` for `batch` rows, in rings of `ring` positions;
    K the convolution's kernel. Its tensors are buffers (not saved), so a model that holds
    it lists them among its own."""

    def __init__(self, batch: int, shapes: Shapes, ring: int, kernel: int, dtype, device) -> None:
        super().__init__()
        self.batch, self.shapes, self.kernel, self.dtype = batch, shapes, kernel, dtype
        self.device = torch.device(device)
        self.ring, self.conv_ring, self.ends = ring, ring + kernel - 2, block_entries(ring)  # R, Rc, Cb
        zeros = dict(device=device)
        self.rec = [torch.zeros(batch, ring + 1, h, dk, dv, **zeros) for _, h, dk, dv in shapes]
        self.conv = [torch.zeros(batch, self.conv_ring + 1, c, dtype=dtype, **zeros) for c, *_ in shapes]
        self.tags = torch.full((batch, ring + 1), -1, dtype=torch.long, **zeros)
        self.block_rec = [torch.zeros(batch, self.ends + 1, h, dk, dv, **zeros) for _, h, dk, dv in shapes]
        self.block_conv = [torch.zeros(batch, self.ends + 1, kernel - 1, c, dtype=dtype, **zeros) for c, *_ in shapes]
        self.block_tags = torch.full((batch, self.ends + 1), -1, dtype=torch.long, **zeros)
        for name, ts in (
            ("rec", self.rec),
            ("conv", self.conv),
            ("block_rec", self.block_rec),
            ("block_conv", self.block_conv),
        ):
            for i, t in enumerate(ts):
                self.register_buffer(f"{name}_{i}", t, persistent=False)
        self.register_buffer("tags_", self.tags, persistent=False)
        self.register_buffer("block_tags_", self.block_tags, persistent=False)
        self.host: list[list[int]] = [[-1] * ring for _ in range(batch)]  # per row: each slot's position
        self.block_host: list[list[int]] = [[-1] * self.ends for _ in range(batch)]  # per row: each entry's
        self.tree_rec: list[list[Tensor]] = []  # per layer two [B, W, H, Dk, Dv] buffers (tree steps)
        self.tree_conv: list[list[Tensor]] = []  # per layer two [B, W, K-1, C]

    @staticmethod
    def state_bytes(shapes: Shapes, kernel: int, dtype) -> int:
        """One row's state after one position, every layer: what a verify writes per token."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(h * dk * dv * 4 + c * size * (kernel - 1) for c, h, dk, dv in shapes)

    @staticmethod
    def bytes_for(batch: int, shapes: Shapes, ring: int, kernel: int, dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        states = (ring + 1 + block_entries(ring) + 1) * LinearStates.state_bytes(shapes, kernel, dtype)
        return batch * (states + sum(c * size for c, *_ in shapes) * (ring + kernel - 1))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        """What captured steps read and write (the runner's graph guard compares them)."""
        pairs = (t for pair in (*self.tree_rec, *self.tree_conv) for t in pair)
        return (*self.rec, *self.conv, self.tags, *self.block_rec, *self.block_conv, self.block_tags, *pairs)

    # ------------------------------------------------------------------ rings
    @staticmethod
    def _slots(positions: Tensor, size: int) -> Tensor:
        """Ring slots of `positions` (any shape); negative positions go to the trash slot."""
        return torch.where(positions >= 0, positions % size, size)

    def _window(self, last: Tensor) -> Tensor:
        """[..., K-1] positions of the convolution inputs up to `last` [...]."""
        return last[..., None] - torch.arange(self.kernel - 2, -1, -1, device=last.device)

    def read(self, layer: int, before: Tensor) -> tuple[Tensor, Tensor]:
        """The state after position `before` [B] (or [B, W]; -1: a row's start, zeros):
        (the K-1 convolution inputs up to it [..., K-1, C], the recurrent state [..., H, Dk, Dv])."""
        lead = before.shape
        rows = torch.arange(self.batch, device=before.device).reshape(-1, *([1] * (len(lead) - 1)))  # [B, 1..]
        at = self._window(before)  # [..., K-1]
        window = self.conv[layer][rows[..., None], self._slots(at, self.conv_ring)]  # [..., K-1, C]
        window = window.masked_fill((at < 0)[..., None], 0.0)
        state = self.rec[layer][rows, self._slots(before, self.ring)]  # [..., H, Dk, Dv]
        return window, state.masked_fill((before < 0).reshape(*lead, 1, 1, 1), 0.0)

    def write(self, layer: int, positions: Tensor, inputs: Tensor, states: Tensor, before: Tensor) -> None:
        """Per position: inputs [B, T, C] and the state after each [B, T, H, Dk, Dv] at
        `positions` [B, T] (consecutive per row); `before` [B, K-1, C] the inputs before
        them. The block ends among them go to the block entries too."""
        B, T = positions.shape
        rows = torch.arange(B, device=positions.device)[:, None]  # [B, 1]
        self.conv[layer][rows, self._slots(positions, self.conv_ring)] = inputs
        slots = self._slots(positions, self.ring)  # [B, T]
        self.rec[layer][rows, slots] = states
        n = -(-T // BLOCK_TOKENS)  # block ends T consecutive positions can hold
        offsets = (BLOCK_TOKENS - 1 - positions[:, :1]) % BLOCK_TOKENS + BLOCK_TOKENS * torch.arange(
            n, device=positions.device
        )  # [B, n]: the block ends' columns
        inside = offsets < T
        offsets = offsets.clamp(max=T - 1)
        ends = positions.gather(1, offsets).masked_fill(~inside, -1)  # [B, n]
        full = torch.cat([before, inputs], dim=1)  # [B, K-1+T, C]
        take = (offsets[..., None] + torch.arange(1, self.kernel, device=positions.device)).reshape(B, -1)
        windows = full.gather(1, take[..., None].expand(-1, -1, full.shape[-1])).reshape(B, n, self.kernel - 1, -1)
        chosen = states.gather(1, offsets.reshape(B, n, 1, 1, 1).expand(-1, -1, *states.shape[2:]))  # [B, n, H, Dk, Dv]
        self._write_blocks(layer, ends, windows, chosen)
        if layer == 0:
            self.tags[rows, slots] = positions

    def write_final(self, layer: int, last: Tensor, window: Tensor, state: Tensor) -> None:
        """The state after position `last` [B] (-1: nothing to write for that row): its
        window [B, K-1, C] (inputs at last-K+2 .. last) and recurrent state [B, H, Dk, Dv]."""
        rows = torch.arange(self.batch, device=last.device)
        at = self._window(last).masked_fill(last[:, None] < 0, -1)  # [B, K-1]
        self.conv[layer][rows[:, None], self._slots(at, self.conv_ring)] = window
        slot = self._slots(last, self.ring)  # [B]
        self.rec[layer][rows, slot] = state
        end = last.masked_fill((last + 1) % BLOCK_TOKENS != 0, -1)[:, None]  # [B, 1]: a block end, or none
        self._write_blocks(layer, end, window[:, None], state[:, None])
        if layer == 0:
            self.tags[rows, slot] = last

    def _write_blocks(self, layer: int, ends: Tensor, windows: Tensor, states: Tensor) -> None:
        """Block-end states at positions `ends` [B, n] (-1: none): windows [B, n, K-1, C],
        states [B, n, H, Dk, Dv]."""
        rows = torch.arange(ends.shape[0], device=ends.device)[:, None]
        entry = self._slots(torch.where(ends >= 0, ends // BLOCK_TOKENS, -1), self.ends)  # [B, n]
        self.block_conv[layer][rows, entry] = windows
        self.block_rec[layer][rows, entry] = states
        if layer == 0:
            self.block_tags[rows, entry] = ends

    # ------------------------------------------------------------------ single rows
    def place(self, row: int, last: int, windows: list[Tensor], states: list[Tensor]) -> None:
        """Row `row`'s state after position `last`: per layer its window [K-1, C] and state
        [H, Dk, Dv] into the ring (and the block entry when `last` is a block end)."""
        conv_slots = self._slots(self._window(torch.tensor(last, device=self.device)), self.conv_ring)  # [K-1]
        entry = (last // BLOCK_TOKENS) % self.ends if (last + 1) % BLOCK_TOKENS == 0 else None
        for layer, (window, state) in enumerate(zip(windows, states)):
            self.conv[layer][row, conv_slots] = window
            self.rec[layer][row, last % self.ring] = state
            if entry is not None:
                self.block_conv[layer][row, entry] = window
                self.block_rec[layer][row, entry] = state
        self.tags[row, last % self.ring] = last
        self.host[row][last % self.ring] = last
        if entry is not None:
            self.block_tags[row, entry] = last
            self.block_host[row][entry] = last

    def block_state(self, row: int, end: int) -> tuple[list[Tensor], list[Tensor]]:
        """Row `row`'s state after block end `end`, per layer (views: copy them)."""
        entry = (end // BLOCK_TOKENS) % self.ends
        return [c[row, entry] for c in self.block_conv], [r[row, entry] for r in self.block_rec]

    # ------------------------------------------------------------------ tree steps
    def tree_width(self, width: int) -> None:
        """Tree buffers for `width` branches per row (allocated once per width)."""
        if self.tree_rec and self.tree_rec[0][0].shape[1] >= width:
            return
        B, K = self.batch, self.kernel
        self.tree_rec = [
            [torch.zeros(B, width, h, dk, dv, device=self.device) for _ in range(2)] for _, h, dk, dv in self.shapes
        ]
        self.tree_conv = [
            [torch.zeros(B, width, K - 1, c, dtype=self.dtype, device=self.device) for _ in range(2)]
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
        """Row `row` takes branch `branch` ([1] long: its column, on the device) of a tree
        that ran `depth` steps: the branch's state becomes the row's after position `last`."""
        windows = [c[depth % 2][row].index_select(0, branch)[0] for c in self.tree_conv]  # [K-1, C] each
        states = [r[depth % 2][row].index_select(0, branch)[0] for r in self.tree_rec]  # [H, Dk, Dv] each
        self.place(row, last, windows, states)

    # ------------------------------------------------------------------ what the host knows
    def knows(self, row: int, position: int) -> bool:
        """Whether the host knows the state after `position` is in row `row`'s ring (-1: the
        start, always)."""
        return position < 0 or self.host[row][position % self.ring] == position

    def knows_block(self, row: int, end: int) -> bool:
        return self.block_host[row][(end // BLOCK_TOKENS) % self.ends] == end

    def truncated(self, row: int, length: int) -> None:
        """Row `row`'s tokens from position `length` on are no longer the ones its states
        were computed for (cut, replaced): the host forgets those states."""
        self.host[row] = [p if p < length else -1 for p in self.host[row]]
        self.block_host[row] = [p if p < length else -1 for p in self.block_host[row]]

    def wrote(self, row: int, positions: range, valid: int) -> None:
        """The host's map after per-position writes at `positions` of row `row`: those below
        `valid` hold the row's states, the rest garbage (padding, rejected tokens)."""
        for p in positions:
            self.host[row][p % self.ring] = p if p < valid else -1
            if (p + 1) % BLOCK_TOKENS == 0:
                self.block_host[row][(p // BLOCK_TOKENS) % self.ends] = p if p < valid else -1

    def wrote_final(self, row: int, last: int) -> None:
        """The host's map after a long feed's write of the state after `last`."""
        self.wrote(row, range(last, last + 1), last + 1)

    def forget(self) -> None:
        """No row holds anything (a reset)."""
        self.host = [[-1] * self.ring for _ in range(self.batch)]
        self.block_host = [[-1] * self.ends for _ in range(self.batch)]
        with torch.inference_mode():  # the tags may have been made in inference mode (a grown ring)
            self.tags.fill_(-1)
            self.block_tags.fill_(-1)

    def grown(self, ring: int) -> LinearStates:
        """A copy with rings of `ring` positions, every position and block end this one
        holds in place (moved by the device tags: no host read)."""
        new = LinearStates(self.batch, self.shapes, ring, self.kernel, self.dtype, self.device)
        rows = torch.arange(self.batch, device=self.device)[:, None]
        held = self.tags[:, : self.ring]  # [B, R]
        slots = new._slots(held, ring)  # [B, R]: -1 tags go to the trash
        at = self._window(held).masked_fill(held[..., None] < 0, -1).reshape(self.batch, -1)  # [B, R*(K-1)]
        src, dst = self._slots(at, self.conv_ring), new._slots(at, new.conv_ring)  # windows overlap: equal values
        ends = self.block_tags[:, : self.ends]  # [B, Cb]
        entries = new._slots(torch.where(ends >= 0, ends // BLOCK_TOKENS, -1), new.ends)
        for layer in range(len(self.shapes)):
            new.rec[layer][rows, slots] = self.rec[layer][:, : self.ring]
            new.conv[layer][rows, dst] = self.conv[layer][rows, src]
            new.block_rec[layer][rows, entries] = self.block_rec[layer][:, : self.ends]
            new.block_conv[layer][rows, entries] = self.block_conv[layer][:, : self.ends]
        new.tags[rows, slots] = held
        new.block_tags[rows, entries] = ends
        new.tags[:, ring], new.block_tags[:, new.ends] = -1, -1
        if self.tree_rec:
            new.tree_width(self.tree_rec[0][0].shape[1])
            for mine, theirs in zip((*self.tree_rec, *self.tree_conv), (*new.tree_rec, *new.tree_conv)):
                for a, b in zip(mine, theirs):
                    b.copy_(a)
        for b in range(self.batch):
            for p in self.host[b]:
                if p >= 0:
                    new.host[b][p % ring] = p
            for p in self.block_host[b]:
                if p >= 0:
                    new.block_host[b][(p // BLOCK_TOKENS) % new.ends] = p
        return new
