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
            f"the {what} needs {human_bytes(need)} on cpu, but only "
            f"{human_bytes(free + freed)} of memory is available",
            OOM_HINT,
        )


class KVCache(nn.Module):
    """k and v, each [B, Hkv, num_slots, D]."""

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
        """Write k_new/v_new [B, Hkv, T, D] at slots [B, T]; return keys/values of slots [0, span).

        Writing first means the caller's attention mask governs the new tokens too.
        """
        batch, length = slots.shape
        rows = torch.arange(batch, device=slots.device)[:, None].expand(batch, length)  # [B, T]
        self.k[rows, :, slots] = k_new.transpose(1, 2)  # [B, Hkv, N, D] <- [B, T, Hkv, D]
        self.v[rows, :, slots] = v_new.transpose(1, 2)  # [B, Hkv, N, D] <- [B, T, Hkv, D]
        return self.k[:, :, :span], self.v[:, :, :span]  # [B, Hkv, S, D] each

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


class KVPool:
    """Stored prefix tokens of one model's layers (backends/prefix.py says which): per
    layer, k and v [Hkv, tokens, D] in the cache's dtype, on the cache's device.

    Allocated once with `torch.empty`: on the CPU the pages are only committed as blocks
    are written, on a GPU the memory is reserved up front. Copies in and out are slice
    copies of runs of blocks consecutive in both (one per run, layer and tensor; indexed
    copies were 10x slower here), written in place into the KV cache (captured steps keep
    reading the same cache tensors)."""

    def __init__(self, layers: int, n_kv_heads: int, tokens: int, head_dim: int, dtype, device) -> None:
        shape = (n_kv_heads, tokens, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]

    @staticmethod
    def bytes_for(layers: int, n_kv_heads: int, tokens: int, head_dim: int, dtype) -> int:
        return layers * KVCache.bytes_for(1, n_kv_heads, tokens, head_dim, dtype)

    def save(self, caches: list[KVCache], row: int, runs: list[tuple[int, int, int]]) -> None:
        """Row `row`'s k/v -> the pool, per run (first cache slot, first pool token, length)."""
        with _one_thread():
            for cache, k, v in zip(caches, self.k, self.v):
                for slot, at, n in runs:
                    k[:, at : at + n].copy_(cache.k[row, :, slot : slot + n])  # [Hkv, n, D]
                    v[:, at : at + n].copy_(cache.v[row, :, slot : slot + n])  # [Hkv, n, D]

    def load(self, caches: list[KVCache], row: int, runs: list[tuple[int, int, int]]) -> None:
        """The pool -> row `row`'s k/v, per run (first cache slot, first pool token, length)."""
        with _one_thread():
            for cache, k, v in zip(caches, self.k, self.v):
                for slot, at, n in runs:
                    cache.k[row, :, slot : slot + n].copy_(k[:, at : at + n])  # [Hkv, n, D]
                    cache.v[row, :, slot : slot + n].copy_(v[:, at : at + n])  # [Hkv, n, D]


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
