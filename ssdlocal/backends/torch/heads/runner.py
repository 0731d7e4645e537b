"""A one-layer draft head's own decoding state (EAGLE-3, heads/eagle3.py; a checkpoint's MTP
layer, heads/mtp.py): its one-layer KV cache (slot = position, as the target's),
each row's length, and each row's state from its last step, all on the device.

`catch_up` feeds the pairs the target has verified (its hidden states with the next tokens)
and returns each row's logits at its last real column; `step` feeds one drafted token with
the row's own state, the way draft.decode.DraftDecoder drives a runner (`step` then
`advance(1)`); each catch-up says where its pairs sit, so the next round overwrites the
drafts that were not accepted (no rollback: the write position is the only state). Knows
nothing about rounds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.heads.eagle3 import Eagle3Head
from ssdlocal.backends.torch.heads.mtp import MtpHead
from ssdlocal.backends.torch.kvcache import KVCache
from ssdlocal.backends.torch.models.base import causal_mask


class HeadRunner:
    """One head (EAGLE-3's, or a checkpoint's MTP layer) over a batch of rows."""

    def __init__(self, head: Eagle3Head | MtpHead, device: torch.device, dtype: torch.dtype) -> None:
        self.head, self.device, self.dtype = head, device, dtype
        self.vocab_size = head.target_vocab
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B]
        self.state: Tensor | None = None  # [B, H]: each row's state after its last step
        self.num_slots = 0

    def reset(self, batch: int, num_slots: int) -> None:
        """A batch of empty rows with room for `num_slots` positions."""
        attn = self.head.attention
        attn.kv_cache = KVCache(batch, attn.n_kv_heads, num_slots, attn.head_dim, self.dtype, self.device)
        self.head.cover(num_slots, self.device)
        self.num_slots = num_slots
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.state = torch.zeros(batch, self.head.args.hidden_size, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def catch_up(self, ids: Tensor, hidden: Tensor, counts: Tensor, start: Tensor, bound: int) -> Tensor:
        """ids [B, T], the target's hidden states [B, T, 3 x its hidden] (the pair of column j
        sits at position start[b] + j), `counts` [B] real columns per row (the rest padding),
        `bound` > every position (host-known) -> logits [B, V] at each row's last real
        column; lengths = start + counts."""
        self.lengths.copy_(start)
        positions = self.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)  # [B, T]
        mask = self._mask(positions, bound)
        logits, state = self.head(ids, hidden.to(self.dtype), positions, mask, fuse=True)  # [B, T, V], [B, T, H]
        last = (counts - 1).clamp(min=0)  # [B]
        rows = torch.arange(ids.shape[0], device=self.device)
        assert self.state is not None
        self.state.copy_(state[rows, last])
        self.lengths += counts
        return logits[rows, last]  # [B, V]

    @torch.inference_mode()
    def step(self, ids: Tensor, bound: int | None = None) -> Tensor:
        """ids [B, 1] at each row's length, with its own state -> logits [B, 1, V]; the
        state moves on, the lengths do not (`advance`)."""
        assert self.state is not None
        positions = self.lengths[:, None]  # [B, 1]
        span = bound if bound is not None else self.num_slots
        logits, state = self.head(ids, self.state[:, None], positions, self._mask(positions, span), fuse=False)
        self.state.copy_(state[:, 0])
        return logits

    def advance(self, n: Tensor | int, host=None) -> None:
        self.lengths += n

    def _mask(self, positions: Tensor, span: int) -> AttentionMask:
        span = min(span, self.num_slots)
        attn = self.head.attention
        return AttentionMask.build(causal_mask(positions, span), attn.n_heads // attn.n_kv_heads, self.dtype)
