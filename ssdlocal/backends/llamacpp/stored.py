"""The llama.cpp runner's prefix store as Runner verbs: reuse, store, read_ahead, forget.

A mixin of LlamaCppRunner (backends/llamacpp/runner.py): which reserved sequence holds
which tokens is prefix.SeqStore's; this module makes the llama.cpp calls (seq_cp into and
out of reserved sequences, decoding a prompt ahead into one). A model whose cells cannot
all be shared by position, a sliding-window one (llama.cpp reuses a cell once it is
outside the window of the only sequence holding it) or a recurrent one (its state exists
only at a sequence's end), is handed stored entries whole (SeqStore.whole).
"""

from __future__ import annotations

from ssdlocal.backends.llamacpp.prefix import SeqStore, common_prefix
from ssdlocal.backends.prefix import store_tokens
from ssdlocal.core.memory import available_ram_bytes


class StoredPrefixes:
    """Runner.setup_prefix / reuse / store / read_ahead / forget_prefixes / prefix_report
    over reserved llama.cpp sequences (the runner's close and _decode, recurrent.py's _cut
    and _forget_row used)."""

    # set by LlamaCppRunner
    lib: object
    loaded: object
    device: object
    alike: bool
    held: list[list[int]]
    prefix: SeqStore | None
    _ctx: object
    _kv: list[list[int]]
    _store_tokens: int
    window: int
    recurrent: bool

    def _store_ids(self, ids: tuple[int, ...]) -> None:
        """The reserved sequences of this context; entries in sequences no longer reserved
        (a larger batch takes them as rows) are dropped."""
        if not ids:
            self.prefix = None
            return
        if self.prefix is None:
            self.prefix = SeqStore(ids, self._store_tokens, whole=bool(self.window or self.recurrent))
        for seq in [s for s in self.prefix.entries if s not in ids]:
            del self.prefix.entries[seq]
        self.prefix.ids = ids

    def setup_prefix(self, asked: int | None) -> int:
        """A prefix store of `asked` tokens (None: the default size, at most a tenth of the
        RAM available; 0: none): cells of the context kept in reserved sequences. llama.cpp
        allocates a context's cells when it creates it, so on a CPU the store's memory is
        committed then; a size that does not fit in the RAM available is refused
        (OutOfMemoryError). Takes effect with the next context. None with alike steps: llama.cpp
        sums attention over cells in cell order, vectorised, so a token's logits also depend on
        where its row's cells sit (measured: up to 0.46 apart when they move by 7 cells, equal
        when by 16); without a store every call starts from an empty cache and they land alike."""
        if self.alike:
            asked = 0
        per_token = self.loaded.kv_bytes_per_token or 1
        free = available_ram_bytes() if self.device.type == "cpu" else None  # a GPU's: llama.cpp's to refuse
        self._store_tokens = store_tokens(asked, per_token, free, "llama.cpp")
        self.close()  # the next reset sizes a context with room for the store
        self.prefix = None
        return self._store_tokens

    def prefix_report(self) -> dict | None:
        return None if self.prefix is None else self.prefix.report()

    def forget_prefixes(self) -> None:
        """Runner.forget_prefixes: the stored sequences' cells go too."""
        if self.prefix is None:
            return
        for seq in self.prefix.clear():
            if self._ctx is not None:
                self.lib.seq_rm(self._ctx, seq, -1, -1)

    def reuse(self, row: int, tokens) -> int:
        """Row `row` (empty after reset) starts from the stored sequence sharing the longest
        prefix with `tokens`: its cells gain the row's sequence id (no data copied)."""
        if self.prefix is None or self.held[row] or self._kv[row]:
            return 0
        seq, n = self.prefix.best(tokens)
        if seq is None or n == 0:
            return 0
        self.lib.seq_cp(self._ctx, seq, row, 0, n)
        self._forget_row(row)
        self._kv[row] = [int(t) for t in tokens[:n]]
        self.held[row] = list(self._kv[row])
        return n

    def store(self, row: int, tokens) -> None:
        """Keep the part of `tokens` that row `row`'s sequence really holds in a reserved one."""
        if self.prefix is None or self._ctx is None:
            return
        n = common_prefix(self._kv[row], tokens)
        if self.recurrent and n < len(self._kv[row]):  # a recurrent state is at the sequence's end
            self._cut(row, n)
            del self.held[row][n:]
        seq, drop = self.prefix.place(tokens[:n])
        for old in drop:
            self.lib.seq_rm(self._ctx, old, -1, -1)
        if seq is not None:
            self.lib.seq_cp(self._ctx, row, seq, 0, n)

    def read_ahead(self, tokens, n: int) -> int:
        """Runner.read_ahead: the next `n` tokens are decoded into a reserved sequence of
        the store (its cells are the store's, rows are not touched), growing the stored
        sequence that holds just the tokens before them, or a copy of the one sharing the
        longest prefix with `tokens`. Nothing is read when the store cannot hold them."""
        if self.prefix is None or self._ctx is None:
            return 0
        source, have = self.prefix.best(tokens, count=False)
        end = min(len(tokens), have + max(n, 0))
        if end <= have:
            return have
        seq, drop = self.prefix.reading(tokens[:end], source, have)
        for old in drop:
            self.lib.seq_rm(self._ctx, old, -1, -1)
        if seq is None:
            return have
        if seq != source and have:
            self.lib.seq_cp(self._ctx, source, seq, 0, have)
        try:
            self._decode(
                [int(t) for t in tokens[have:end]], range(have, end), [seq] * (end - have), [False] * (end - have)
            )
        except BaseException:  # the entry still holds what it held: drop the cells written
            if not self.lib.seq_rm(self._ctx, seq, have, -1):  # a recurrent state moved: the entry goes
                self.lib.seq_rm(self._ctx, seq, -1, -1)
                self.prefix.entries.pop(seq, None)
            raise
        self.prefix.record(seq, tokens[:end])
        return end
