"""The prefix store's index: which token prefixes earlier calls left behind, in whole blocks.

A runner keeps the keys/values of earlier calls' tokens in a pool of fixed-size blocks
(backends/torch/kvcache.py, KVPool); this index says which pool block holds which tokens. A block
is known by its own tokens and its parent block, so by every token from the start of the
sequence to its end (what vLLM's block hashes cover), and blocks form a tree: a lookup
walks it from the root along the prompt. Blocks are evicted least recently used, leaves
first (a block's descendants are unreachable without it). New blocks become visible only
after their keys/values were written, so a failed or interrupted copy leaves nothing a
later call could trust. Knows nothing about tensors, models or devices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ssdlocal.core.config import PREFIX_CACHE_TOKENS
from ssdlocal.core.errors import OutOfMemoryError
from ssdlocal.core.memory import human_bytes

BLOCK_TOKENS = 16  # tokens per block: a prompt is reused up to its last whole stored block
ROOT = -1  # the parent of a sequence's first block
AUTO_SHARE = 0.1  # the default store takes at most this share of the memory free after loading


def store_tokens(asked: int | None, bytes_per_token: int, free: int | None, what: str) -> int:
    """Tokens of a model's prefix store, in whole blocks.

    `asked` None: PREFIX_CACHE_TOKENS, or fewer so it takes at most AUTO_SHARE of `free`
    (bytes free on the model's device, None when unknown). An explicit size that does not
    fit in `free` is refused (OutOfMemoryError naming the size asked and what fits)."""
    fits = None if free is None else int(free // max(bytes_per_token, 1)) // BLOCK_TOKENS * BLOCK_TOKENS
    if asked is None:
        auto = min(PREFIX_CACHE_TOKENS, int(AUTO_SHARE * fits) if fits is not None else PREFIX_CACHE_TOKENS)
        return auto // BLOCK_TOKENS * BLOCK_TOKENS
    if fits is not None and asked > fits:
        raise OutOfMemoryError(
            f"a prefix cache of {asked:,} tokens needs {human_bytes(asked * bytes_per_token)} for {what}, "
            f"but only {human_bytes(free)} is free there (room for about {fits:,} tokens)",
            f"use --prefix-cache-tokens {fits // 2 // BLOCK_TOKENS * BLOCK_TOKENS} or less "
            "(0 or --no-prefix-cache turns it off)",
        )
    return asked // BLOCK_TOKENS * BLOCK_TOKENS


@dataclass
class _Block:
    number: int  # the pool block holding its keys/values
    parent: int  # the parent's pool block, ROOT for a sequence's first block
    tokens: tuple[int, ...]
    children: int = 0


@dataclass(frozen=True)
class Placement:
    """Where one new block goes: tokens [index * BLOCK, (index + 1) * BLOCK) of the stored
    sequence, copied into pool block `number`."""

    index: int
    number: int


class PrefixIndex:
    """Token blocks -> pool blocks, for `capacity` pool blocks of `block_tokens` tokens."""

    def __init__(self, capacity: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity < 0 or block_tokens < 1:
            raise ValueError(f"bad prefix index shape: {capacity} blocks of {block_tokens}")  # a caller bug
        self.capacity = capacity
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # by pool block, oldest use first
        self._by_key: dict[tuple[int, tuple[int, ...]], _Block] = {}  # (parent, tokens) -> block
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest number
        self.lookups = 0
        self.hit_tokens = 0
        self.stored_blocks = 0
        self.evicted_blocks = 0

    @property
    def used(self) -> int:
        """Pool blocks holding a stored prefix."""
        return len(self._blocks)

    def _chain(self, tokens: Sequence[int]) -> list[_Block]:
        """The stored blocks along `tokens`, from the first, as far as they match."""
        size, parent, found = self.block_tokens, ROOT, []
        for start in range(0, len(tokens) - size + 1, size):
            block = self._by_key.get((parent, tuple(tokens[start : start + size])))
            if block is None:
                break
            found.append(block)
            parent = block.number
        return found

    def _touch(self, chain: list[_Block]) -> None:
        """Mark `chain` just used, deepest first: a parent stays more recent than its children."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.number)

    def match(self, tokens: Sequence[int], count: bool = True) -> list[int]:
        """Pool blocks of the longest stored prefix of `tokens` (whole blocks), in order.
        `count` False: a look that is no lookup of a row (not in the report's counts)."""
        chain = self._chain(tokens)
        self._touch(chain)
        self.lookups += count
        self.hit_tokens += len(chain) * self.block_tokens if count else 0
        return [block.number for block in chain]

    def insert(self, tokens: Sequence[int], write: Callable[[list[Placement]], None]) -> int:
        """Store the whole blocks of `tokens` not stored yet; returns how many were added.

        Each new block gets a free pool block, or the least recently used leaf that is not
        on this sequence's own path; when none is left the rest is not stored. The pool
        blocks taken go to the new blocks in ascending order (fewer, longer copy runs). `write` copies
        the new blocks' keys/values into their pool blocks; only when it returns do the
        blocks join the index (if it raises, their pool blocks are free again)."""
        chain = self._chain(tokens)
        self._touch(chain)
        size = self.block_tokens
        protected = {block.number for block in chain}
        numbers: list[int] = []
        for _ in range(len(chain), len(tokens) // size):
            number = self._take_block(protected)
            if number is None:
                break
            protected.add(number)
            numbers.append(number)
        # In ascending order: eviction frees a chain leaf first (descending numbers), and
        # blocks consecutive in both the sequence and the pool are copied as one run.
        placements = [Placement(len(chain) + i, n) for i, n in enumerate(sorted(numbers))]
        if not placements:
            return 0
        try:
            write(placements)
        except BaseException:
            self._free.extend(p.number for p in placements)
            raise
        parent = chain[-1].number if chain else ROOT
        for p in placements:
            block = _Block(p.number, parent, tuple(tokens[p.index * size : (p.index + 1) * size]))
            self._add(block)
            parent = block.number
        self.stored_blocks += len(placements)
        return len(placements)

    def key(self, number: int) -> tuple[int, tuple[int, ...]] | None:
        """What pool block `number` holds now (its parent block and its tokens), None when
        it holds nothing: a store keeping more per block checks it is still the same one."""
        block = self._blocks.get(number)
        return None if block is None else (block.parent, block.tokens)

    def _add(self, block: _Block) -> None:
        self._blocks[block.number] = block
        self._by_key[(block.parent, block.tokens)] = block
        if block.parent != ROOT:
            self._blocks[block.parent].children += 1

    def _take_block(self, protected: set[int]) -> int | None:
        """A free pool block, evicting the least recently used unprotected leaf if needed."""
        if self._free:
            return self._free.pop()
        for number, block in self._blocks.items():  # oldest first
            if block.children == 0 and number not in protected:
                self._remove(block)
                self.evicted_blocks += 1
                return number
        return None

    def _remove(self, block: _Block) -> None:
        del self._blocks[block.number]
        del self._by_key[(block.parent, block.tokens)]
        if block.parent != ROOT:
            self._blocks[block.parent].children -= 1

    def clear(self) -> None:
        """Forget every stored block (the pool's contents are no longer trusted)."""
        self._blocks.clear()
        self._by_key.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def report(self) -> dict[str, int]:
        """Counts for stats: capacity and use in tokens, lookups, reused and stored tokens."""
        size = self.block_tokens
        return {
            "capacity_tokens": self.capacity * size,
            "used_tokens": self.used * size,
            "block_tokens": size,
            "lookups": self.lookups,
            "reused_tokens": self.hit_tokens,
            "stored_tokens": self.stored_blocks * size,
            "evicted_tokens": self.evicted_blocks * size,
        }
