"""A Gemma 4 assistant's decoding state over a batch of rows: each row's position and state,
on the device. It has no cache: every forward reads the target's (HeadInputs.read_kv) as it is.

`catch_up` takes the pairs the target verified in HeadRunner's form and keeps each row's
last one, (the target's final hidden state after token q, token q + 1): the assistant reads
it at position q + 1 over the target's keys of positions 0..q. `step` feeds a drafted token
with the row's own state at that same position; `advance` moves nothing, since every draft
of a round sits at one position and reads the same keys (transformers'
SinglePositionMultiTokenCandidateGenerator). Knows nothing about rounds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.backends.base import HeadInputs
from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.heads.gemma4_assistant import Gemma4Assistant
from ssdlocal.backends.torch.models.gemma3 import FULL


class AssistantRunner:
    """One assistant beside the target whose embeddings, hidden states and cache it reads."""

    def __init__(self, head: Gemma4Assistant, shared: HeadInputs, device) -> None:
        if shared.read_kv is None:
            raise RuntimeError("a Gemma 4 assistant needs the target's cache")  # load_assistant refused first
        self.head, self.dtype, self.device = head, shared.dtype, torch.device(device)
        self.read_kv = shared.read_kv
        self.embed, self.embed_scale = shared.embeddings, shared.embed_scale
        self.vocab_size = head.args.text.vocab_size
        self.groups = {kind: head.args.text.num_heads // shared.kv[i].kv_heads for kind, i in head.args.reads.items()}
        self.position = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]: q + 1
        self.state: Tensor | None = None  # [B, backbone]: the next step's state
        self.span = 1  # slots the keys come from: > every row's q (host-known)
        self.num_slots = 0

    def reset(self, batch: int, num_slots: int) -> None:
        """A batch of rows with positions below `num_slots`."""
        self.head.cover(num_slots + 1, self.device)
        self.num_slots = num_slots
        self.position = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.state = torch.zeros(batch, self.head.args.backbone, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def catch_up(self, ids: Tensor, hidden: Tensor, counts: Tensor, start: Tensor, bound: int) -> Tensor:
        """ids [B, T], the target's final hidden states [B, T, D] (column j: the state after
        the token at position start[b] + j, ids[b, j] the token after it), `counts` [B] real
        columns (0: a row that took nothing, drafting garbage harmlessly), `bound` > every
        position + 1 (host-known) -> the logits of each row's next draft [B, V]."""
        rows = torch.arange(ids.shape[0], device=self.device)
        last = (counts - 1).clamp(min=0)  # [B]
        self.position.copy_(start + last + 1)  # [B]: the token's position; keys end one before it
        self.span = min(bound, self.num_slots)
        return self._forward(ids[rows, last], hidden[rows, last])[:, 0]  # [B, V]

    @torch.inference_mode()
    def step(self, ids: Tensor, bound: int | None = None) -> Tensor:
        """ids [B, 1]: each row's newest draft, with its own state -> logits [B, 1, V]."""
        assert self.state is not None  # reset ran
        return self._forward(ids[:, 0], self.state)

    def advance(self, n: Tensor | int, host=None) -> None:
        """Nothing moves: the next draft sits at the same position."""

    def _forward(self, tokens: Tensor, state: Tensor) -> Tensor:
        """tokens [B], states [B, backbone] -> logits [B, 1, V]; the row states move on."""
        embeds = self.embed(tokens)  # [B, D], in the target's dtype
        if self.embed_scale is not None:  # as the target scales them (float32, then its dtype)
            embeds = embeds * torch.full((), self.embed_scale, device=embeds.device).to(embeds.dtype)
        inputs = torch.cat([embeds, state.to(embeds.dtype)], dim=-1)[:, None]  # [B, 1, 2D]
        positions = self.position[:, None]  # [B, 1]
        kv, masks = {}, {}
        window = self.head.args.text.sliding_window
        for kind, layer in self.head.args.reads.items():
            keys, values = self.read_kv(layer)  # [B, Hkv, slots, Dh] each
            span = min(self.span, keys.shape[2])
            kv[kind] = keys[:, :, :span], values[:, :, :span]
            slots = torch.arange(span, device=self.device)  # [S]
            newest = positions[:, :, None] - 1  # [B, 1, 1]: q, the last key's position
            sees = slots <= newest  # [B, 1, S]
            if kind != FULL and window is not None:  # the last window + 1 keys (inclusive distance)
                sees = sees & (slots >= newest - window)
            masks[kind] = AttentionMask.build(sees, self.groups[kind], embeds.dtype)
        logits, next_state = self.head(inputs, positions, kv, masks)  # [B, 1, V], [B, 1, backbone]
        assert self.state is not None
        self.state.copy_(next_state[:, 0])
        return logits
