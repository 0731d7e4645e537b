"""A llama.cpp runner's rows in and out of its prefix store (backends/llamacpp/prefix.py).

`reuse` restores a stored row's saved sequence state into an empty row and cuts it to the
shared prefix (a row alone in its context: only whole chunks a cold read gives bit for bit,
so its cells stay cells 0, 1, ... and its logits those of a cold read); `store` saves a
finished row's state; `read_ahead` reads a waiting prompt into the reading sequence, which
goes to the store at the next reset. A state is cut only where it still holds what the row
needs (`StateStore.cuts_to`): a recurrent model's never (its state exists only at a
sequence's end, and llama.cpp cannot drop its tail: a row is cut back by recurrent.py
before it is kept, and its entries are used whole); a sliding-window model's only where
the window before the cut is all there (`Entry.first`): llama.cpp saves a sliding layer's
cells within the last position's window only, so a stored entry serves rows that take it
whole or all but its last token, and a live sequence may lose earlier positions too
(llama.cpp reuses a cell outside the window of the only sequence holding it and then
drops that sequence's positions up to it: seq_pos_min). A mixin of LlamaCppRunner
(backends/llamacpp/runner.py), whose context, rows (`_kv`, `held`, `_exact`), `_decode`,
reading sequence and recurrent.py's `_cut` / `_forget_row` it uses.
"""

from __future__ import annotations

from ssdlocal.backends.llamacpp.prefix import StateStore, common_prefix
from ssdlocal.backends.prefix import store_tokens
from ssdlocal.core.errors import SSDLocalError
from ssdlocal.core.memory import available_ram_bytes

PAD = 256  # llama.cpp rounds the context size up to this


class StoredRows:
    """Runner.setup_prefix / prefix_report / reuse / store / read_ahead / forget_prefixes
    over a StateStore."""

    # set by LlamaCppRunner
    lib: object
    loaded: object
    device: object
    prefix: StateStore | None
    held: list[list[int]]
    num_slots: int
    tree: bool
    alike: bool
    window: int
    recurrent: bool
    _ctx: object
    _ctx_cells: int
    _n_batch: int
    _store_tokens: int
    _kv: list[list[int]]
    _exact: list[int]
    _read_seq: int
    _reading: list[int]

    def setup_prefix(self, asked: int | None) -> int:
        """A prefix store of `asked` tokens (None: the default size, at most a tenth of the
        RAM available; 0: none): finished rows' saved states (backends/llamacpp/prefix.py),
        and as many cells of the context kept to read waiting prompts ahead. llama.cpp
        allocates a context's cells when it creates it, so on a CPU that room's memory is
        committed then; a size that does not fit in the RAM available is refused
        (OutOfMemoryError). Takes effect with the next context. None with alike steps, whose
        prompts are read in other chunks (alike.plan_calls): every call starts from an empty
        cache, so a request's cells land alike in every mode."""
        if self.alike:
            asked = 0
        per_token = self.loaded.kv_bytes_per_token or 1
        free = available_ram_bytes() if self.device.type == "cpu" else None  # a GPU's: llama.cpp's to refuse
        self._store_tokens = store_tokens(asked, per_token, free, "llama.cpp")
        self.close()  # the next reset sizes a context with room to read ahead
        store = StateStore(self._store_tokens, whole=self.recurrent, window=self.window)
        self.prefix = store if self._store_tokens else None
        self._reading = []
        return self._store_tokens

    def prefix_report(self) -> dict | None:
        return None if self.prefix is None else self.prefix.report()

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
        lone = self._lone()  # the rest is read in the chunks a cold read uses
        entry, n = self.prefix.best(tokens, exact=lone, chunk=self._n_batch if lone else 1)
        in_use = sum(map(len, self._kv)) + len(self._reading)
        if entry is None or n == 0 or entry.cells > self._ctx_cells - in_use - PAD:
            return 0
        try:
            self.lib.set_seq_state(self._ctx, row, entry.state)
        except SSDLocalError:  # no contiguous room for it here (a batch's cells interleave): read it
            self.lib.seq_rm(self._ctx, row, -1, -1)
            return 0
        if n < entry.cells:
            self.lib.seq_rm(self._ctx, row, n, -1)
        self._forget_row(row)  # a recurrent row's checkpoints were of another state
        self.prefix.counted(n)
        self._kv[row] = [int(t) for t in tokens[:n]]
        self.held[row] = list(self._kv[row])
        self._exact[row] = n if lone else 0
        return n

    def store(self, row: int, tokens) -> None:
        """Keep the part of `tokens` that row `row`'s sequence really holds: its state saved
        (a recurrent row's cut back there first: its state is at its end)."""
        if self.prefix is None or self._ctx is None:
            return
        kv = self._kv[row]
        n = common_prefix(kv, tokens)
        if self.recurrent and n < len(kv):
            self._cut(row, n)
            del self.held[row][n:]
        first = self._saved_first(row, len(kv))
        exact = min(self._exact[row], n)
        if self.prefix.cuts_to(first, n) or n == len(kv):
            if self.prefix.wanted(tokens[:n], exact):
                state = self.lib.seq_state(self._ctx, row)
                self.prefix.put([int(t) for t in tokens[:n]], state, len(kv), exact, first)

    def _first(self, seq: int) -> int:
        """The first position whose cells sequence `seq` still holds (sliding windows)."""
        return max(0, self.lib.seq_pos_min(self._ctx, seq)) if self.window else 0

    def _saved_first(self, seq: int, cells: int) -> int:
        """The first position a saved state of sequence `seq` (`cells` positions) holds in
        every layer: llama.cpp saves a sliding-window layer's cells within the window of
        the sequence's last position only (measured on tiny gemma3, gemma4 and gpt-oss
        GGUFs, window 8: a 20-token row restored from its state starts at 12, a 100-token
        one at 92), and the live sequence may start later still (`_first`)."""
        return max(self._first(seq), cells - self.window) if self.window else 0

    def read_ahead(self, tokens, n: int) -> int:
        """Runner.read_ahead: the next `n` tokens are decoded into the reading sequence (rows
        are not touched), which grows while it holds the tokens before them, else starts
        from the stored row sharing the longest prefix with `tokens`; it goes to the store
        at the next reset. Nothing is read when the context's reading room cannot hold them."""
        if self.prefix is None or self._ctx is None or self._read_seq < 0:
            return 0
        kept = common_prefix(self._reading, tokens)
        if kept < len(self._reading) and not self.prefix.cuts_to(self._first(self._read_seq), kept):
            kept = 0  # it cannot be cut there (a recurrent state, a window gone): it is read again
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
            if stored < entry.cells:
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
            if not self.lib.seq_rm(self._ctx, self._read_seq, have, -1):  # a recurrent state moved: all go
                self._drop_reading()
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
                first = self._saved_first(self._read_seq, len(self._reading))
                self.prefix.put(self._reading, state, len(self._reading), 0, first)

    def _drop_reading(self) -> None:
        if self._reading and self._ctx is not None and self._read_seq >= 0:
            self.lib.seq_rm(self._ctx, self._read_seq, -1, -1)
        self._reading = []
