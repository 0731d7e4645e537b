"""The static KV cache of one attention layer: a fixed array of slots per row.

Allocated once (zeros, so slots never written hold no NaN); the model writes each new
token's k/v into the slot its caller chose and reads the first S slots back. Which
tokens a row's slots hold is the runner's bookkeeping, not the cache's: rejected drafts
need no rollback, the next write simply lands in the same slots (as in gpt-fast).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ssdlocal.core.errors import OutOfMemoryError
from ssdlocal.core.memory import OOM_HINT, available_ram_bytes, human_bytes


SLOT_ROUNDING = 256  # cache capacity grows in these steps


def rounded_slots(slots: int) -> int:
    """`slots` rounded up to a whole number of SLOT_ROUNDING steps."""
    return -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING


def free_bytes(device) -> int | None:
    """Memory free on `device` for new tensors: available RAM on the CPU, the driver's free
    memory on a GPU; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    return available_ram_bytes() if device.type == "cpu" else None


def check_room(need: int, device, what: str, freed: int = 0) -> None:
    """Refuse an allocation of `need` bytes on the CPU that cannot fit in the memory
    available (plus `freed`, what the caller releases first): on Linux a too-large
    allocation often succeeds lazily and then swaps the machine to a standstill.
    CUDA allocations fail at once by themselves (mapped by the caller)."""
    if torch.device(device).type != "cpu":
        return
    free = available_ram_bytes()
    if free is not None and need > free + freed:
        raise OutOfMemoryError(
            f"the {what} needs {human_bytes(need)} on cpu, but only {human_bytes(free + freed)} of memory is available",
            OOM_HINT,
        )


class KVCache(nn.Module):
    """k and v, each [R, Hkv, num_slots, D]: R rows, of which a batch of B uses the first B."""

    def __init__(self, batch: int, n_kv_heads: int, num_slots: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, num_slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @staticmethod
    def bytes_for(batch: int, n_kv_heads: int, num_slots: int, head_dim: int, dtype) -> int:
        """Bytes of one layer's k and v together."""
        return 2 * batch * n_kv_heads * num_slots * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def tensors(self) -> tuple[Tensor, Tensor]:
        return self.k, self.v

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    def update(self, slots: Tensor, k_new: Tensor, v_new: Tensor, span: int) -> tuple[Tensor, Tensor]:
        """Write k_new/v_new [B, Hkv, T, D] at slots [B, T] of the first B rows; return the
        first B rows' keys/values of slots [0, span) (a cache sized for a larger batch keeps
        its other rows untouched).

        Writing first means the caller's attention mask governs the new tokens too.
        """
        batch, length = slots.shape
        rows = torch.arange(batch, device=slots.device)[:, None].expand(batch, length)  # [B, T]
        self.k[rows, :, slots] = k_new.transpose(1, 2)  # [R, Hkv, N, D] <- [B, T, Hkv, D]
        self.v[rows, :, slots] = v_new.transpose(1, 2)  # [R, Hkv, N, D] <- [B, T, Hkv, D]
        return self.k[:batch, :, :span], self.v[:batch, :, :span]  # [B, Hkv, S, D] each

    def grown(self, num_slots: int) -> KVCache:
        """A larger cache holding this one's contents in its first slots."""
        batch, heads, old, dim = self.k.shape
        bigger = KVCache(batch, heads, num_slots, dim, self.k.dtype, self.k.device)
        bigger.k[:, :, :old] = self.k
        bigger.v[:, :, :old] = self.v
        return bigger

    def copy_slots(self, row: int, src: Tensor, dst: Tensor) -> None:
        """Copy row `row`'s k/v from slots `src` [n] to slots `dst` [n]."""
        self.k[row, :, dst] = self.k[row, :, src]  # [Hkv, n, D]
        self.v[row, :, dst] = self.v[row, :, src]  # [Hkv, n, D]


SLICE_RUNS_CPU = 4  # on the CPU, up to this many runs are copied as slices; more as one indexed copy


class KVPool:
    """Stored prefix tokens of one model's layers (backends/prefix.py says which): per
    layer, k and v [Hkv, tokens, D] (that layer's heads and width) in the cache's dtype, on
    the cache's device.

    Allocated once with `torch.empty`: on the CPU the pages are only committed as blocks
    are written, on a GPU the memory is reserved up front. A save or load is a list of
    runs (blocks consecutive in both the cache row and the pool) and costs, per layer and
    tensor, one copy operation when it is one run; otherwise one indexed copy
    (`index_copy_` / `index_select` with a device index built once per call) on a GPU,
    where each copy is a kernel launch, and on the CPU slice copies up to SLICE_RUNS_CPU
    runs (a slice copy costs its bytes there; an indexed copy of one contiguous run was
    1.5x slower, of 128 scattered blocks 6x faster than their 128 slice copies). So the
    copy operations of a call never grow with how fragmented the pool is. Copies land in
    place in the KV cache (captured steps keep reading the same cache tensors). `copies`
    counts the operations issued (one per slice or indexed copy of one tensor)."""

    def __init__(self, shapes: list[tuple[int, int]], tokens: int, dtype, device) -> None:
        """`shapes`: per layer (kv heads, head width)."""
        self.k = [torch.empty((h, tokens, d), dtype=dtype, device=device) for h, d in shapes]
        self.v = [torch.empty((h, tokens, d), dtype=dtype, device=device) for h, d in shapes]
        self.device = torch.device(device)
        self.copies = 0

    @staticmethod
    def bytes_for(shapes: list[tuple[int, int]], tokens: int, dtype) -> int:
        return sum(KVCache.bytes_for(1, h, tokens, d, dtype) for h, d in shapes)

    def _copies(
        self, caches: list[KVCache], runs: list[tuple[int, int, int]]
    ) -> Iterator[tuple[_CopyPlan, Tensor, Tensor]]:
        """A save's or load's plan with (pool tensor, cache tensor) of each layer's k, then v,
        copied on one CPU thread; counts the plan's operations per tensor."""
        plan = _CopyPlan.of(runs, self.device)
        with _one_thread():
            for cache, k, v in zip(caches, self.k, self.v):
                for pool_t, cache_t in ((k, cache.k), (v, cache.v)):
                    yield plan, pool_t, cache_t
                    self.copies += plan.operations

    def save(self, caches: list[KVCache], row: int, runs: list[tuple[int, int, int]]) -> None:
        """Row `row`'s k/v -> the pool, per run (first cache slot, first pool token, length)."""
        for plan, pool_t, cache_t in self._copies(caches, runs):
            if plan.slots is None:
                for slot, at, n in runs:
                    pool_t[:, at : at + n].copy_(cache_t[row, :, slot : slot + n])  # [Hkv, n, D]
            else:  # [Hkv, N, D] -> pool tokens plan.tokens [N]
                pool_t.index_copy_(1, plan.tokens, plan.cache_side(cache_t[row]))

    def load(self, caches: list[KVCache], row: int, runs: list[tuple[int, int, int]]) -> None:
        """The pool -> row `row`'s k/v, per run (first cache slot, first pool token, length)."""
        for plan, pool_t, cache_t in self._copies(caches, runs):
            if plan.slots is None:
                for slot, at, n in runs:
                    cache_t[row, :, slot : slot + n].copy_(pool_t[:, at : at + n])  # [Hkv, n, D]
            elif isinstance(plan.slots, slice):  # written in place into the cache's view
                torch.index_select(pool_t, 1, plan.tokens, out=cache_t[row, :, plan.slots])  # [Hkv, N, D]
            else:
                cache_t[row].index_copy_(1, plan.slots, pool_t.index_select(1, plan.tokens))


class _CopyPlan:
    """How one save/load copies its runs: `slots` None (one slice copy per run), a slice
    (the cache side is one contiguous range) or a device index of cache slots [N]; `tokens`
    the device index of pool tokens [N] (indexed copies only); `operations` per tensor."""

    __slots__ = ("slots", "tokens", "operations")

    def __init__(self, slots, tokens: Tensor | None, operations: int) -> None:
        self.slots, self.tokens, self.operations = slots, tokens, operations

    @classmethod
    def of(cls, runs: list[tuple[int, int, int]], device: torch.device) -> _CopyPlan:
        if len(runs) <= 1 or (device.type == "cpu" and len(runs) <= SLICE_RUNS_CPU):
            return cls(None, None, len(runs))
        tokens = _device_index([(at, n) for _, at, n in runs], device)  # [N]
        first, total = runs[0][0], sum(n for _, _, n in runs)
        if all(slot == first + sum(n for _, _, n in runs[:i]) for i, (slot, _, _) in enumerate(runs)):
            return cls(slice(first, first + total), tokens, 1)
        return cls(_device_index([(slot, n) for slot, _, n in runs], device), tokens, 2)

    def cache_side(self, row_tensor: Tensor) -> Tensor:
        """The cache row's [Hkv, N, D] that the plan's slots name (a view when contiguous)."""
        if isinstance(self.slots, slice):
            return row_tensor[:, self.slots]
        return row_tensor.index_select(1, self.slots)


def _device_index(ranges: list[tuple[int, int]], device: torch.device) -> Tensor:
    """[sum n] long on `device`: start, start+1, .. start+n-1 for each (start, n), built on
    the host and sent once (pinned, without waiting, on a GPU)."""
    host = torch.cat([torch.arange(start, start + n) for start, n in ranges])  # [N]
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@contextmanager
def _one_thread() -> Iterator[None]:
    """CPU copies run on one thread: memory-bound, one core nearly saturates it, and a
    parallel copy waits for every thread of the pool (measured here on a busy 2-core CPU:
    57 MB in 9.5 ms on one thread, 640 ms on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def runs_of(pairs: list[tuple[int, int]], size: int) -> list[tuple[int, int, int]]:
    """(cache block, pool block) pairs -> copy runs (first slot, first pool token, tokens):
    blocks consecutive in both become one run (one copy per layer instead of many)."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == src * size and last[1] + last[2] == dst * size:
            last[2] += size
        else:
            runs.append([src * size, dst * size, size])
    return [tuple(r) for r in runs]
