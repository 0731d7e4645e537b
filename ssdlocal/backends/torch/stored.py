"""The torch runner's prefix store: earlier calls' prefixes kept in whole 16-token blocks of
a KV pool beside the batch's cache (backends.prefix.PrefixIndex says which blocks hold
what), taken back by a new row (`reuse`), kept after a call (`store`), and a waiting
prompt read into it between rounds (`read_ahead`, on a one-row cache of its own:
backends.torch.ahead). A mixin of TorchRunner: it reads the runner's model, rows and cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdlocal.backends.prefix import BLOCK_TOKENS, Placement, PrefixIndex, store_tokens
from ssdlocal.backends.torch.kvcache import free_bytes, runs_of


class StoredPrefixes:
    """Runner.setup_prefix, reuse, store, read_ahead, forget_prefixes over the model's pool."""

    prefix: PrefixIndex | None = None  # earlier calls' prefixes (setup_prefix)
    prefix_token_bytes = 0

    def setup_prefix(self, asked: int | None) -> int:
        """A prefix store of `asked` tokens (None: the default size, see
        backends.prefix.store_tokens; 0: none), replacing any earlier one; returns its size."""
        self.prefix = None
        self.model.setup_prefix_pool(0, self.loaded.dtype, self.device)  # free the old pool first
        per_token = self.model.prefix_pool_bytes(1, self.loaded.dtype)
        tokens = store_tokens(asked, per_token, free_bytes(self.device), f"{self.loaded.args.arch} on {self.device}")
        self.model.setup_prefix_pool(tokens, self.loaded.dtype, self.device)
        self.prefix = PrefixIndex(tokens // BLOCK_TOKENS) if tokens else None
        self.prefix_token_bytes = per_token
        return tokens

    def forget_prefixes(self) -> None:
        """Runner.forget_prefixes."""
        if self.prefix is not None:
            self.prefix.clear()

    def prefix_report(self) -> dict | None:
        """The store's counts (backends.prefix.PrefixIndex.report) and its bytes, or None."""
        if self.prefix is None:
            return None
        report = self.prefix.report()
        return {
            **report,
            "capacity_bytes": report["capacity_tokens"] * self.prefix_token_bytes,
            "used_bytes": report["used_tokens"] * self.prefix_token_bytes,
        }

    @torch.inference_mode()
    def reuse(self, row: int, tokens: Sequence[int]) -> int:
        """Row `row` (holding nothing yet, after `reset`) takes the longest stored prefix of
        `tokens` (whole blocks) into its first slots; returns how many tokens it holds now."""
        if self.prefix is None or self.held[row]:
            return 0
        return self.load_stored(row, tokens)

    def load_stored(self, row: int, tokens: Sequence[int], count: bool = True) -> int:
        """`reuse`'s copy; `count` False for a look that is no row's lookup (StagingRow)."""
        numbers = self.prefix.match(tokens, count)
        n = len(numbers) * BLOCK_TOKENS
        if n:
            self._ensure(n)
            self.model.load_prefix(row, runs_of(list(enumerate(numbers)), BLOCK_TOKENS))
            self.held[row] = list(tokens[:n])
        return n

    @torch.inference_mode()
    def store(self, row: int, tokens: Sequence[int]) -> None:
        """Slots 0..len(tokens)-1 of row `row` hold `tokens` (the caller knows: after steps,
        `held` is not kept): keep their whole blocks for later calls' `reuse`."""
        if self.prefix is None:
            return

        def write(placements: list[Placement]) -> None:
            self.model.save_prefix(row, runs_of([(p.index, p.number) for p in placements], BLOCK_TOKENS))

        self.prefix.insert(tokens, write)

    def read_ahead(self, tokens: Sequence[int], n: int) -> int:
        """Runner.read_ahead, on a one-row cache of its own (backends.torch.ahead); whole
        blocks. A tensor-parallel group reads nothing ahead (its caches are allocated once)."""
        if self.prefix is None or not self.plain:
            return 0
        return self.staging.read(tokens, n)
