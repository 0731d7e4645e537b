"""A hybrid model's linear-attention states on a tensor-parallel group
(backends/torch/models/hybrid.py): every rank keeps the linear layers whole, so rank 0's
`TPModel` mirrors each change of their states (ring growth, a reset, the context of a long
feed or a tree step) to the other ranks by a command before making it on its own shard.
A mixin of TPModel: it reads `shard` and `group`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ssdlocal.parallel.rank import Cmd


class LinearStatesOnRanks:
    """HybridLM's state methods for a TPModel (group.py), mirrored on every rank."""

    shard: Any  # the rank-0 shard (a HybridLM)
    group: Any  # its RankGroup

    @property
    def linear_states(self):
        return self.shard.linear_states

    @property
    def ring(self) -> int:
        return self.shard.ring

    def grow_ring(self, ring: int) -> None:
        self.group.command_all(Cmd.RING, ring)
        self.shard.grow_ring(ring)

    def forget_states(self) -> None:
        self.group.command_all(Cmd.FORGET, None)
        self.shard.forget_states()

    @contextmanager
    def context(self, ends=None, tree: int | None = None) -> Iterator[None]:
        self.group.command_all(Cmd.LINEAR_ENTER, (None if ends is None else list(ends), tree))
        try:
            with self.shard.context(ends, tree):
                yield
        finally:
            self.group.command_all(Cmd.LINEAR_LEAVE, None)
