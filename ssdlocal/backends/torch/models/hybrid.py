"""A causal LM whose decoder layers mix attention and linear attention (Gated DeltaNet,
deltanet.py): the attention layers keep the KV cache the shell gives every family, the
linear layers keep per-row states in rings by position (backends/torch/linear_states.py),
allocated, installed and swapped with the KV caches as one more entry of `caches()`.

What a caller adds for such a model (backends/torch/hybrid_runner.py does it): the
`ctx` (LinearContext) around a long feed or a tree step, and `grow_ring` before a step
could overwrite a position a row may return to.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.kvcache import KVCache, check_room
from ssdlocal.backends.torch.linear_states import LinearContext, LinearStates
from ssdlocal.backends.torch.models.base import CausalLM, ModelArgs, allocating
from ssdlocal.backends.torch.models.deltanet import GatedDeltaNet

RING_START = 8  # positions per row a ring starts with (the runner grows it for wider steps)


class HybridLM(CausalLM):
    """CausalLM with linear-attention layers: a decoder layer that has `linear_attn` (a
    GatedDeltaNet) keeps its state in `linear_states`, shared by all of them."""

    def __init__(self, args: ModelArgs) -> None:
        self.ctx = LinearContext()
        super().__init__(args)
        for index, layer in enumerate(self.linear_layers()):
            layer.ctx, layer.index = self.ctx, index
        self.ring = RING_START
        self.linear_states: LinearStates | None = None

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]

    def linear_shapes(self) -> list[tuple[int, int, int, int]]:
        """Per linear layer (channels, value heads, key width, value width), per rank under TP."""
        return [layer.state_shape() for layer in self.linear_layers()]

    @property
    def kernel(self) -> int:
        return self.linear_layers()[0].kernel

    # ------------------------------------------------------------------ caches
    def _check_caches(self, batch_size: int, num_slots: int, dtype, device, freed: int = 0) -> None:
        kv = sum(KVCache.bytes_for(batch_size, h, num_slots, d, dtype) for h, d in self._layer_shapes())
        states = LinearStates.bytes_for(batch_size, self.linear_shapes(), self.ring, self.kernel, dtype)
        check_room(kv + states, device, f"KV cache and states of {batch_size} x {num_slots} slots", freed=freed)

    def setup_cache(self, batch_size: int, num_slots: int, dtype, device) -> None:
        self._install(None)  # free the old states before allocating
        super().setup_cache(batch_size, num_slots, dtype, device)

    def _allocate_caches(self, batch_size: int, num_slots: int, dtype, device) -> list:
        caches = super()._allocate_caches(batch_size, num_slots, dtype, device)
        with allocating(f"allocating the linear-attention states of {batch_size} rows on {device}"):
            states = LinearStates(batch_size, self.linear_shapes(), self.ring, self.kernel, dtype, device)
        return [*caches, states]

    def use_caches(self, caches: list) -> None:
        """Install `caches()`' entries: the KV caches, then the linear states."""
        super().use_caches(caches[:-1])
        self._install(caches[-1])

    def caches(self) -> list:
        return [*super().caches(), self.linear_states]

    def _install(self, states: LinearStates | None) -> None:
        self.linear_states = states
        for layer in self.linear_layers():
            layer.states = states

    def grow_ring(self, ring: int) -> None:
        """Rings of `ring` positions per row, keeping every position they hold."""
        assert self.linear_states is not None  # setup_cache ran
        with allocating(f"growing the linear-attention states to {ring} positions per row"):
            self._install(self.linear_states.grown(ring))
        self.ring = ring

    # ------------------------------------------------------------------ forward
    def forget_states(self) -> None:
        """No row holds a state any more (a runner's reset)."""
        if self.linear_states is not None:
            self.linear_states.forget()

    @contextmanager
    def context(self, ends: Sequence[int] | None = None, tree: int | None = None) -> Iterator[None]:
        """Run the linear layers as a long feed (`ends`: each row's end position) or a tree
        step of depth `tree` for the calls inside; per position otherwise."""
        if ends is not None:
            device = self.embed_tokens.weight.device
            host = torch.tensor(list(ends), dtype=torch.long)  # [B]
            staged = host.pin_memory() if device.type == "cuda" else host
            self.ctx.ends = staged.to(device, non_blocking=True)
        self.ctx.tree, self.ctx.carry = tree, {}
        try:
            yield
        finally:
            self.ctx.ends, self.ctx.tree, self.ctx.positions, self.ctx.carry = None, None, None, {}

    def forward(self, input_ids: Tensor, positions: Tensor, *rest, **options) -> Tensor | tuple[Tensor, Tensor]:
        """CausalLM.forward (the rest of its arguments as they come); a tree step's linear
        layers read the queries' positions."""
        if self.ctx.tree is not None:
            self.ctx.positions = positions
        return super().forward(input_ids, positions, *rest, **options)


class HybridBlock(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)): the mixer is attention (`self_attn`) or a
    GatedDeltaNet (`linear_attn`); `norm()` makes the family's norms."""

    rope = "global"

    def __init__(self, mixer: nn.Module, mlp: nn.Module, norm) -> None:
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask) -> Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, slots)  # [B, T, hidden]
        else:
            x = x + self.self_attn(h, cos, sin, slots, mask)  # [B, T, hidden]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, hidden]


def hybrid_state_bytes(model: nn.Module) -> int:
    """Bytes of one row's state after one position, every linear layer (0 for other models)."""
    if not isinstance(model, HybridLM):
        return 0
    dtype = next(model.parameters()).dtype
    return LinearStates.state_bytes(model.linear_shapes(), model.kernel, dtype)


__all__ = ["HybridBlock", "HybridLM", "RING_START", "hybrid_state_bytes"]
