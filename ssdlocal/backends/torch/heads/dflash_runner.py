"""A DFlash drafter's own decoding state: its layers' KV caches (slot = position, as the
target's), where each row's context starts and ends, all on the device.

`add_context` writes the keys and values of positions the target has verified (from its
hidden states there); `draft` runs one block [last verified token, mask x (block_size - 1)]
at the next positions and returns block_size - 1 draft logits per row. The block's own
keys and values land in the slots after the context and are overwritten by the next
context write (no rollback: the write position is the only state). A row's positions
before `first` were never given (a stored prefix the target did not read): masked out.
Knows nothing about rounds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.heads.dflash import DFlashHead
from ssdlocal.backends.torch.kvcache import KVCache


class BlockRunner:
    """One DFlash drafter over a batch of rows."""

    def __init__(self, head: DFlashHead, device: torch.device, dtype: torch.dtype) -> None:
        self.head, self.device, self.dtype = head, device, dtype
        self.block_size = head.args.block_size
        self.hidden_layers = head.args.hidden_layers  # the target's hidden states it reads
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B]: context positions held (0..n-1)
        self.first = torch.zeros(0, dtype=torch.long, device=device)  # [B]: the first position held
        self.num_slots = 0
        self.offsets = torch.arange(self.block_size, device=device)  # [bs]

    def reset(self, batch: int, num_slots: int) -> None:
        """A batch of empty rows whose contexts may reach `num_slots` positions."""
        self.num_slots = num_slots + self.block_size  # the last block runs past the context
        for layer in self.head.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(batch, attn.n_kv_heads, self.num_slots, attn.head_dim, self.dtype, self.device)
        self.head.cover(self.num_slots, self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.first = torch.zeros(batch, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def add_context(self, hidden: Tensor, start: Tensor, counts: Tensor, opening: bool = False) -> None:
        """The target's states `hidden` [B, T, n x D] of positions start[b] + j, j <
        counts[b] (the rest padding: it lands in slots the next block overwrites first);
        lengths = start + counts. `opening`: the first context of the rows (they hold
        nothing before `start`)."""
        positions = (start[:, None] + torch.arange(hidden.shape[1], device=self.device)).clamp(max=self.num_slots - 1)
        self.head.context(hidden.to(self.dtype), positions)  # [B, T] slots
        if opening:
            self.first.copy_(start)
        self.lengths.copy_(start + counts)

    @torch.inference_mode()
    def draft(self, last: Tensor, bound: int) -> Tensor:
        """last [B] long: each row's newest token, at position lengths[b] -> float32 logits
        [B, block_size - 1, V] for the positions after it. `bound` (host-known) >= every
        row's length + block_size."""
        args = self.head.args
        positions = self.lengths[:, None] + self.offsets  # [B, bs]
        ids = torch.full_like(positions, args.mask_token_id)  # [B, bs]
        ids[:, 0] = last
        span = min(bound, self.num_slots)
        slots = torch.arange(span, device=self.device)  # [S]
        held = (slots >= self.first[:, None]) & (slots < self.lengths[:, None] + self.block_size)  # [B, S]
        masks: dict[int | None, AttentionMask] = {}
        groups = args.num_heads // args.num_kv_heads
        for reach in set(args.reach):
            seen = held[:, None, :].expand(-1, self.block_size, -1)  # [B, bs, S]
            if reach is not None:  # a sliding layer: |query position - slot| <= reach
                seen = seen & ((positions[:, :, None] - slots).abs() <= reach)  # [B, bs, S]
            masks[reach] = AttentionMask.build(seen, groups, self.dtype)
        return self.head.block(ids, positions, [masks[r] for r in args.reach])  # [B, bs - 1, V]
