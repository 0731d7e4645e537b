"""What the torch runner drives on rank 0 of a tensor-parallel target: the local shard,
mirrored on every other rank by its RankGroup (group.py), with the same verbs as a
Transformer (cache, prefix pool, forward) and rank 0's graph cache, whose evictions and
refusals the ranks follow. Knows the group only through its verbs.
"""

from __future__ import annotations

import weakref

from ssdlocal.core.config import GraphMode
from ssdlocal.parallel.linear_ranks import LinearStatesOnRanks
from ssdlocal.parallel.rank import Cmd


class TPModel(LinearStatesOnRanks):
    """What TorchRunner sees on rank 0: the local shard, mirrored on every other rank."""

    def __init__(self, shard, group) -> None:  # group: a group.RankGroup
        self.shard = shard
        self.group = group
        self.args = shard.args  # per-rank head counts
        self.layers = shard.layers
        self.graphs = None  # rank 0's GraphCache (use_graphs)

    def setup_cache(self, batch_size: int, num_slots: int, dtype, device) -> None:
        self.group.command_all(Cmd.CACHE, (batch_size, num_slots))
        self.shard.setup_cache(batch_size, num_slots, dtype, device)
        self.group.collect_acks()

    def prefix_pool_bytes(self, tokens: int, dtype) -> int:
        """Bytes on each rank (the shards' kv heads)."""
        return self.shard.prefix_pool_bytes(tokens, dtype)

    def setup_prefix_pool(self, tokens: int, dtype, device) -> None:
        self.group.command_all(Cmd.PREFIX_POOL, tokens)
        self.shard.setup_prefix_pool(tokens, dtype, device)
        self.group.collect_acks()

    def save_prefix(self, row, runs) -> None:
        """Every rank copies its shard's k/v (no reply: the pipe keeps the order)."""
        self.group.command_all(Cmd.PREFIX_SAVE, (row, runs))
        self.shard.save_prefix(row, runs)

    def load_prefix(self, row, runs) -> None:
        self.group.command_all(Cmd.PREFIX_LOAD, (row, runs))
        self.shard.load_prefix(row, runs)

    def use_graphs(self, mode: GraphMode):
        """Captured steps on every rank in graph mode `mode` (graphs.resolve_mode); returns
        rank 0's GraphCache (the runner's `graphs`: its counts, its `clear`), or None."""
        from ssdlocal.backends.torch.graphs import GraphCache, capture_backend, resolve_mode

        backend = capture_backend(self.group.device, mode)
        me = weakref.proxy(self)  # no reference cycle through the cache (see TorchRunner)
        self.graphs = None if backend is None else GraphCache(backend, me)
        if self.graphs is not None:  # the ranks let go of what rank 0's cache lets go
            group = self.group
            self.graphs.on_forget = lambda key: group.command_all(Cmd.DROP, key)
        self.group.command_all(Cmd.GRAPHS, resolve_mode(mode) if backend is not None else GraphMode.OFF)
        self.group.collect_acks()
        return self.graphs

    # graphs.StaticTensors, for rank 0's shard (the other ranks run the same code)
    def registered(self):
        yield from self.shard.parameters()
        yield from self.shard.buffers()

    def state_tensors(self) -> tuple:
        caches = (t for cache in self.shard.caches() for t in cache.tensors())
        return (*self.shard.rope_tables(), *caches)

    def describe(self, tensor) -> str:
        for name, value in (*self.shard.named_parameters(), *self.shard.named_buffers()):
            if value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                return f"shard.{name}"
        return f"a {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor made at capture"

    def __call__(self, ids, positions, slots, mask, keep=None, *, capture: bool = False):
        """ids/positions/slots [B, T] long, mask [B, T, S] bool (on rank 0's device) ->
        logits [B, T, V], or [B, n, V] at the query indices `keep` [B, n] (rank 0's lm_head
        only: the other ranks compute no logits). `capture`: a decode or tree step whose
        shape recurs, replayed from a graph on every rank when graphs are on (then the
        logits are a static buffer: read them before the next forward)."""
        graphs = self.graphs if capture and keep is None else None
        return self.group.forward(self.shard, ids, positions, slots, mask, keep, graphs=graphs)
