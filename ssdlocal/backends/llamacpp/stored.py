"""A llama.cpp runner's rows in and out of its prefix store (backends/llamacpp/prefix.py).

`reuse` restores a stored row's saved sequence state into an empty row and cuts it to the
shared prefix (a row alone in its context: only whole chunks a cold read gives bit for bit,
so its cells stay cells 0, 1, ... and its logits those of a cold read); `store` saves a
finished row's state; `read_ahead` reads a waiting prompt into the reading sequence, which
goes to the store at the next reset. A mixin of LlamaCppRunner (backends/llamacpp/runner.py),
whose context, rows (`_kv`, `held`, `_exact`), `_decode` and reading sequence it uses.
"""

from __future__ import annotations

from ssdlocal.backends.llamacpp.prefix import StateStore, common_prefix
from ssdlocal.core.errors import SSDLocalError

PAD = 256  # llama.cpp rounds the context size up to this


class StoredRows:
    """Runner.reuse / store / read_ahead / forget_prefixes over a StateStore."""

    # set by LlamaCppRunner
    lib: object
    prefix: StateStore | None
    held: list[list[int]]
    num_slots: int
    tree: bool
    alike: bool
    _ctx: object
    _ctx_cells: int
    _n_batch: int
    _kv: list[list[int]]
    _exact: list[int]
    _read_seq: int
    _reading: list[int]

    def _lone(self) -> bool:
        """A row alone in its context: its cells are cells 0, 1, ... for its positions."""
        return len(self.held) == 1 and not (self.tree or self.alike)

    def _room(self) -> int:
        """Cells of the context that neither the rows' reservation nor the pad may take."""
        return self._ctx_cells - len(self.held) * self.num_slots - PAD

    def forget_prefixes(self) -> None:
        """Runner.forget_prefixes: stored rows, and what was read ahead."""
        if self.prefix is not None:
            self.prefix.clear()
        self._drop_reading()

    def reuse(self, row: int, tokens) -> int:
        """Row `row` (empty after reset) starts from the stored row sharing the longest
        prefix with `tokens`: its saved state restored into the row's sequence and cut there.
        A lone row takes only whole chunks that a cold read gives bit for bit (`Entry.exact`),
        so it reads the rest as a cold read would; its cells stay cells 0, 1, ..."""
        if self.prefix is None or self.held[row] or self._kv[row]:
            return 0
        lone = self._lone()
        entry, n = self.prefix.best(tokens, exact=lone)
        if lone:
            n = n // self._n_batch * self._n_batch  # the rest is read in the chunks a cold read uses
        in_use = sum(map(len, self._kv)) + len(self._reading)
        if entry is None or n == 0 or entry.cells > self._ctx_cells - in_use - PAD:
            return 0
        try:
            self.lib.set_seq_state(self._ctx, row, entry.state)
        except SSDLocalError:  # no contiguous room for it here (a batch's cells interleave): read it
            self.lib.seq_rm(self._ctx, row, -1, -1)
            return 0
        self.lib.seq_rm(self._ctx, row, n, -1)
        self.prefix.counted(n)
        self._kv[row] = [int(t) for t in tokens[:n]]
        self.held[row] = list(self._kv[row])
        self._exact[row] = n if lone else 0
        return n

    def store(self, row: int, tokens) -> None:
        """Keep the part of `tokens` that row `row`'s sequence really holds: its state saved."""
        if self.prefix is None or self._ctx is None:
            return
        n = common_prefix(self._kv[row], tokens)
        exact = min(self._exact[row], n)
        if self.prefix.wanted(tokens[:n], exact):
            state = self.lib.seq_state(self._ctx, row)
            self.prefix.put([int(t) for t in tokens[:n]], state, len(self._kv[row]), exact)

    def read_ahead(self, tokens, n: int) -> int:
        """Runner.read_ahead: the next `n` tokens are decoded into the reading sequence (rows
        are not touched), which grows while it holds the tokens before them, else starts
        from the stored row sharing the longest prefix with `tokens`; it goes to the store
        at the next reset. Nothing is read when the context's reading room cannot hold them."""
        if self.prefix is None or self._ctx is None or self._read_seq < 0:
            return 0
        kept = common_prefix(self._reading, tokens)
        entry, stored = self.prefix.best(tokens, count=False)
        have = max(kept, stored)
        end = min(len(tokens), have + max(n, 0))
        if end <= have:
            return have
        if end > self._room() or (stored > kept and entry is not None and entry.cells > self._room()):
            return have
        if kept < len(self._reading):  # another prompt, or one that parts from it: keep it, then cut
            self._save_reading()
            self.lib.seq_rm(self._ctx, self._read_seq, kept, -1)
            self._reading = self._reading[:kept]
        if stored > kept:
            self.lib.seq_rm(self._ctx, self._read_seq, -1, -1)
            self._reading = []
            try:
                self.lib.set_seq_state(self._ctx, self._read_seq, entry.state)
            except SSDLocalError:
                self.lib.seq_rm(self._ctx, self._read_seq, -1, -1)
                return have
            self.lib.seq_rm(self._ctx, self._read_seq, stored, -1)
            self._reading = [int(t) for t in tokens[:stored]]
        try:
            self._decode(
                [int(t) for t in tokens[have:end]],
                range(have, end),
                [self._read_seq] * (end - have),
                [False] * (end - have),
            )
        except BaseException:  # the reading sequence still holds what it held: drop the cells written
            self.lib.seq_rm(self._ctx, self._read_seq, have, -1)
            raise
        self._reading = [int(t) for t in tokens[:end]]
        return end

    def _put_reading(self) -> None:
        """What was read ahead goes to the store and leaves the context."""
        self._save_reading()
        self._drop_reading()

    def _save_reading(self) -> None:
        """What was read ahead goes to the store (its state saved; read beside other rows, it
        is no cold read: nothing of it is exact)."""
        if self._reading and self._ctx is not None and self.prefix is not None:
            if self.prefix.wanted(self._reading, 0):
                state = self.lib.seq_state(self._ctx, self._read_seq)
                self.prefix.put(self._reading, state, len(self._reading), 0)

    def _drop_reading(self) -> None:
        if self._reading and self._ctx is not None and self._read_seq >= 0:
            self.lib.seq_rm(self._ctx, self._read_seq, -1, -1)
        self._reading = []
