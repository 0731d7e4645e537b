"""LlamaCppRunner: the Runner protocol (backends/base.py) over a llama.cpp context.

Row b of a batch is llama.cpp sequence b in one unified KV cache. `held[b]` means what
it means for every runner (tokens of row b whose keys/values are cached); `sync` only
shortens it, so before touching row b the runner removes the cache cells past the
common prefix of `held[b]` and what it really wrote (`_kv[b]`) with
llama_memory_seq_rm. SSD tree decoding (`forward_raw`) maps each branch to its own
sequence: the row's prefix cells are shared with it by seq_cp (no data copy), its own
tokens are decoded in one llama_batch per step with every other branch, and
`take_branch` hands an accepted branch's cells back to the row (seq_cp).
Knows nothing about speculation beyond the slot/mask pattern of forward_raw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ssdlocal.backends.base import HeldRows, Logits
from ssdlocal.backends.llamacpp.prefix import STORE_SEQUENCES, SeqStore, common_prefix
from ssdlocal.backends.prefix import store_tokens
from ssdlocal.core.errors import UsageError
from ssdlocal.core.memory import available_ram_bytes

N_BATCH = 512  # most tokens per llama_decode call (llama.cpp's n_batch == n_ubatch)
_PAD = 256  # llama.cpp rounds the context size up to this


@dataclass
class _Chain:
    """One tree branch: llama.cpp sequence `seq` = row's first n_main tokens + own tokens."""

    row: int
    n_main: int
    prefix: list[int]  # the row's tokens 0..n_main-1 when the branch was made
    slots: list[int] = field(default_factory=list)  # scratch slots written, in order
    tokens: list[int] = field(default_factory=list)  # their tokens


class LlamaCppRunner(HeldRows):
    """Feeds variable-length token lists per row through a llama.cpp model.

    `tree=True` sizes the context for SSD tree decoding (many sequences).
    """

    def __init__(self, loaded, *, tree: bool = False) -> None:
        self.loaded = loaded
        self.lib = loaded.lib
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.args.vocab_size
        self.threads = loaded.threads  # None: torch.get_num_threads() at each decode
        self.tree = tree
        self.held: list[list[int]] = []
        self.num_slots = 0
        self._ctx = None
        self._ctx_cells = 0
        self._ctx_seqs = 0
        self._ctx_threads = 0
        self._n_batch = N_BATCH
        self._kv: list[list[int]] = []  # per row: tokens really in sequence b
        self._lengths: list[int] = []  # per row: cached tokens while decoding with `step`
        self._step_base: list[int] = []  # per row: cached tokens at begin_steps
        self._chains: dict[int, _Chain] = {}  # branch sequence id -> chain
        self._scratch: dict[tuple[int, int], int] = {}  # (row, slot) -> branch sequence id
        self._free: list[int] = []
        self._store_tokens = 0  # the prefix store's cells (setup_prefix)
        self.prefix: SeqStore | None = None  # earlier calls' prefixes, in reserved sequences

    # ------------------------------------------------------------------ lifecycle
    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows (the prefix store's sequences stay); (re)create the context when
        it is too small, which empties the store. Rows and the store share the context's
        cells: when the rows need more than the context has beside a full store, but the
        store keeps at least half of its cells, the store gives up cells (least recently
        used entries out) instead of a new context being made (seconds for a large one,
        and the store lost): a request joining a serving batch does not stall the rows
        already running."""
        max_seqs = self.lib.max_sequences()
        if (max_seqs if self.tree else batch_size) < batch_size or batch_size > max_seqs:
            raise UsageError(
                f"llama.cpp supports at most {max_seqs} parallel sequences, asked for {batch_size} rows",
                "use fewer prompts per call",
            )
        stored = min(STORE_SEQUENCES, max_seqs - batch_size) if self._store_tokens else 0
        seqs = max_seqs if self.tree or stored else batch_size  # all of them: a new batch size keeps the context
        row_cells, store = batch_size * num_slots, self._store_tokens if stored else 0
        cells = -(-(row_cells + store) // _PAD) * _PAD
        spare = self._ctx_cells - row_cells - _PAD  # what the store may keep in this context
        if self._ctx is None or seqs > self._ctx_seqs or (cells > self._ctx_cells and spare < store // 2):
            self.close()
            if self._ctx_cells:  # growing: leave room, so the store is not dropped at every step
                cells = max(cells, min(2 * self._ctx_cells, cells + self._store_tokens))
            self._n_batch = min(N_BATCH, cells)
            # no flash attention on a CPU: measured on the 1.5B Q4_K_M pair (2-core EPYC,
            # AVX-512), 28 new tokens after 2,105 took 0.84-0.94 s with llama.cpp's auto choice
            # (on) and 0.50-0.55 s without; one-token steps and cold prompts no slower
            self._ctx = self.lib.new_context(self.model, cells, self._n_batch, seqs, self._want_threads(),
                                             flash_attn=False if self.device.type == "cpu" else None)  # fmt: skip
            self._ctx_cells, self._ctx_seqs = cells, seqs
            self._ctx_threads = self._want_threads()
        else:
            self._drop_chains()
            kept = set(self.prefix.ids) if self.prefix is not None else set()
            for seq in range(self._ctx_seqs):
                if seq not in kept or seq < batch_size:  # rows (and branches) start empty
                    self.lib.seq_rm(self._ctx, seq, -1, -1)
        self._store_ids(tuple(range(seqs - stored, seqs)) if stored else ())
        if self.prefix is not None:
            for seq in self.prefix.fit(min(store, max(0, self._ctx_cells - row_cells - _PAD))):
                self.lib.seq_rm(self._ctx, seq, -1, -1)
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self._count_end()
        self._kv = [[] for _ in range(batch_size)]
        self._chains.clear()
        self._scratch.clear()
        first_store = self.prefix.ids[0] if self.prefix is not None and self.prefix.ids else self._ctx_seqs
        self._free = list(range(first_store - 1, batch_size - 1, -1))  # pop() gives the lowest

    # ------------------------------------------------------------------ prefix store
    def _store_ids(self, ids: tuple[int, ...]) -> None:
        """The reserved sequences of this context; entries in sequences no longer reserved
        (a larger batch takes them as rows) are dropped."""
        if not ids:
            self.prefix = None
            return
        if self.prefix is None:
            self.prefix = SeqStore(ids, self._store_tokens)
        for seq in [s for s in self.prefix.entries if s not in ids]:
            del self.prefix.entries[seq]
        self.prefix.ids = ids

    def setup_prefix(self, asked: int | None) -> int:
        """A prefix store of `asked` tokens (None: the default size, at most a tenth of the
        RAM available; 0: none): cells of the context kept in reserved sequences. llama.cpp
        allocates a context's cells when it creates it, so on a CPU the store's memory is
        committed then; a size that does not fit in the RAM available is refused
        (OutOfMemoryError). Takes effect with the next context."""
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

    def graph_report(self, since: dict | None = None) -> dict:
        """Runner.graph_report: llama.cpp captures nothing of ours."""
        return {"mode": "off", **dict.fromkeys(("captured", "replays", "eager", "refused", "dropped"), 0)}

    def reuse(self, row: int, tokens) -> int:
        """Row `row` (empty after reset) starts from the stored sequence sharing the longest
        prefix with `tokens`: its cells gain the row's sequence id (no data copied)."""
        if self.prefix is None or self.held[row] or self._kv[row]:
            return 0
        seq, n = self.prefix.best(tokens)
        if seq is None or n == 0:
            return 0
        self.lib.seq_cp(self._ctx, seq, row, 0, n)
        self._kv[row] = [int(t) for t in tokens[:n]]
        self.held[row] = list(self._kv[row])
        return n

    def store(self, row: int, tokens) -> None:
        """Keep the part of `tokens` that row `row`'s sequence really holds in a reserved one."""
        if self.prefix is None or self._ctx is None:
            return
        n = common_prefix(self._kv[row], tokens)
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
            self._decode([int(t) for t in tokens[have:end]], range(have, end), [seq] * (end - have),
                         [False] * (end - have))  # fmt: skip
        except BaseException:  # the entry still holds what it held: drop the cells written
            self.lib.seq_rm(self._ctx, seq, have, -1)
            raise
        self.prefix.record(seq, tokens[:end])
        return end

    def close(self) -> None:
        if self._ctx is not None:
            self.lib.free_context(self._ctx)
            self._ctx = None
        if self.prefix is not None:
            self.prefix.clear()  # its cells went with the context

    def __del__(self) -> None:  # the model outlives contexts; free ours first
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def _want_threads(self) -> int:
        # the CPU placement (placement.py) sets torch's thread count for each process
        return self.threads or max(1, torch.get_num_threads())

    # ------------------------------------------------------------------ rows
    def _reconcile(self, row: int) -> None:
        """Drop cells of sequence `row` past the common prefix of held[row] and _kv[row]."""
        kv, held = self._kv[row], self.held[row]
        n = min(len(kv), len(held))
        if kv[:n] != held[:n]:
            n = next(i for i in range(n) if kv[i] != held[i])
        if n < len(kv):
            self.lib.seq_rm(self._ctx, row, n, -1)
            del kv[n:]
        if len(held) > n:
            raise RuntimeError(f"row {row}: held tokens that were never fed to llama.cpp")  # a bug

    def _decode(self, tokens, positions, seqs, want=None, progress=None) -> np.ndarray:
        """Decode in chunks of n_batch; float32 logits [N wanted, V] for the tokens whose
        `want` flag is set (default: every token). `progress(done, total)` after each chunk
        (tokens of the whole batch); an exception it raises stops the decode."""
        threads = self._want_threads()
        if threads != self._ctx_threads:
            self.lib.set_threads(self._ctx, threads)
            self._ctx_threads = threads
        want = [True] * len(tokens) if want is None else want
        out = []
        step = self._n_batch
        for i in range(0, len(tokens), step):
            sl = slice(i, i + step)
            out.append(self.lib.decode(self._ctx, tokens[sl], positions[sl], seqs[sl], want[sl], self.vocab_size))
            if progress is not None:
                progress(min(i + step, len(tokens)), len(tokens))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def feed(self, rows: Sequence[Sequence[int]], logits: Logits = Logits.ALL, progress=None) -> list[torch.Tensor]:
        """Append rows[b] to row b's cache and return their logits.

        Returns per row a float32 tensor: `logits` ALL [len(rows[b]), V], LAST [1, V]
        (the row's last token), NONE [0, V]; empty rows give [0, V]. llama.cpp computes
        logits only for the tokens asked for. ValueError when `logits` is no Logits.
        """
        logits = Logits.of(logits)
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        want: list[bool] = []
        for b, r in enumerate(rows):
            if not r:
                continue
            self._reconcile(b)
            start = len(self.held[b])
            if start + len(r) > self.num_slots:
                raise RuntimeError("KV cache too small for this step")  # engine sizes it; a bug
            tokens.extend(int(t) for t in r)
            positions.extend(range(start, start + len(r)))
            seqs.extend([b] * len(r))
            want.extend([logits is Logits.ALL] * (len(r) - 1) + [logits is not Logits.NONE])
        if not tokens:
            return [torch.empty(0, self.vocab_size) for _ in rows]
        t_max = max(map(len, rows))
        report = None if progress is None else (lambda done, total: progress(done * t_max // total, t_max))
        try:
            out = torch.from_numpy(self._decode(tokens, positions, seqs, want, report))  # [N wanted, V]
        except BaseException:  # stopped or failed part-way: drop the cells it wrote
            for b, r in enumerate(rows):
                if r:
                    self.lib.seq_rm(self._ctx, b, len(self._kv[b]), -1)
            raise
        per_row = {Logits.ALL: None, Logits.LAST: 1, Logits.NONE: 0}[logits]
        result = []
        offset = 0
        for b, r in enumerate(rows):
            n = len(r) if per_row is None or not r else per_row
            result.append(out[offset : offset + n])
            offset += n
            if r:
                self.held[b].extend(int(t) for t in r)
                self._kv[b].extend(int(t) for t in r)
        return result

    # ------------------------------------------------------------------ decode steps
    def begin_steps(self) -> None:
        """Start decoding with `step` (see TorchRunner.step): lengths from what is cached."""
        self._lengths = [len(h) for h in self.held]
        self._step_base = list(self._lengths)
        self._count_begin()

    def end_steps(self, kept) -> None:
        """Rows in `kept` hold their cached tokens at `begin_steps` + kept[row]; the others
        forget what steps fed them (the next feed drops those cells, see _reconcile)."""
        for row, held in enumerate(self.held):
            del held[self._step_base[row] :]
            held.extend(kept.get(row, ()))
        self._count_end()

    def step(self, ids: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """ids [B, T] at positions lengths..lengths+T-1 of each row -> logits [B, T, V]."""
        rows = ids.tolist()
        for b, held in enumerate(self.held):
            del held[self._lengths[b] :]  # rejected tokens of the last step
        return torch.stack(self.feed(rows))  # [B, T, V]

    def advance(self, n, host: Sequence[int] | None = None) -> None:
        """lengths += n (a [B] tensor or one int for every row; `host`: the same on the host)."""
        values = host if host is not None else n.tolist() if isinstance(n, torch.Tensor) else [n] * len(self._lengths)
        self._lengths = [length + int(k) for length, k in zip(self._lengths, values)]
        self._count_advance(n, values)

    # ------------------------------------------------------------------ tree decoding (SSD)
    def forward_raw(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Runner.forward_raw for tree masks; does not touch `held`.

        ids, positions, slots [B, T] long; mask [B, T, S] bool. Query (b, t) writes slot
        slots[b, t] and may see a prefix 0..n-1 of row b's cached tokens plus the scratch
        slots one earlier branch wrote (its chain). The last slot is the trash slot of
        padded queries (skipped; their logits are zeros). Returns [B, T, V] float32.
        """
        batch, width = ids.shape
        trash = self.num_slots - 1
        ids_l, pos_l, slot_l = ids.tolist(), positions.tolist(), slots.tolist()
        live = [(b, t) for b in range(batch) for t in range(width) if slot_l[b][t] != trash]
        visible = {q: mask[q[0], q[1]].nonzero().flatten().tolist() for q in live}
        continues = any((b, s) in self._scratch and s != slot_l[b][t] for (b, t), vis in visible.items() for s in vis)
        if not continues:
            self._drop_chains()  # a new tree: no query continues an earlier branch
        claimed: set[int] = set()
        plan: list[tuple[int, int, _Chain, int]] = []  # (b, t, chain, seq)
        for b, t in live:
            self._reconcile(b)
            chain, seq = self._chain_for(b, slot_l[b][t], visible[(b, t)], pos_l[b][t], claimed)
            claimed.add(seq)
            plan.append((b, t, chain, seq))
        out = torch.zeros(batch, width, self.vocab_size)  # [B, T, V]
        if not plan:
            return out
        logits = self._decode(
            [ids_l[b][t] for b, t, _, _ in plan],
            [pos_l[b][t] for b, t, _, _ in plan],
            [seq for _, _, _, seq in plan],
        )  # [N, V]
        for i, (b, t, chain, seq) in enumerate(plan):
            out[b, t] = torch.from_numpy(logits[i])
            chain.slots.append(slot_l[b][t])
            chain.tokens.append(ids_l[b][t])
            self._chains[seq] = chain
            self._scratch[(b, slot_l[b][t])] = seq
        return out

    def _chain_for(self, b: int, own: int, visible: list[int], position: int, claimed: set[int]) -> tuple[_Chain, int]:
        """The branch chain and llama.cpp sequence for row b's query writing slot `own`
        that sees `visible` slots at `position`: a new chain off the row's cached prefix,
        or the one earlier branch it continues. NotImplementedError for masks that are not
        such trees."""
        if (b, own) in self._scratch:
            raise NotImplementedError("forward_raw: a slot is written twice in one tree")
        main = [s for s in visible if (b, s) not in self._scratch and s != own]
        scratch = [s for s in visible if (b, s) in self._scratch and s != own]
        n_main = len(main)
        if main != list(range(n_main)) or n_main > len(self._kv[b]):
            raise NotImplementedError("forward_raw: a query must see a prefix of its row's cached tokens")
        if not scratch:
            seq = self._alloc()
            self.lib.seq_cp(self._ctx, b, seq, 0, n_main)
            chain = _Chain(b, n_main, self._kv[b][:n_main])
        else:
            parent = self._scratch[(b, scratch[0])]
            chain = self._chains[parent]
            if sorted(scratch) != sorted(chain.slots) or chain.n_main != n_main:
                raise NotImplementedError("forward_raw: a query must see one whole branch")
            if parent in claimed:
                raise NotImplementedError("forward_raw: two queries continue one branch")
            seq = parent
        if position != chain.n_main + len(chain.slots):
            raise NotImplementedError("forward_raw: branch positions must be consecutive")
        return chain, seq

    def tree_width(self, width: int) -> int:
        """No padding: every branch is its own llama.cpp sequence."""
        return width

    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """Adopt the branch written at scratch slots `src` as the row's tokens from `start`."""
        self._copy_slots(row, list(src), list(range(start, start + len(src))))
        held = self.held[row]
        del held[start:]
        held.extend(tokens)

    def _copy_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Make the branch written at scratch slots `src` row `row`'s tokens at `dst`.

        dst must be consecutive positions starting where the branch leaves the row's
        prefix (what the speculator does when a cached branch is taken).
        """
        if not src:
            return
        seq = self._scratch.get((row, src[0]))
        chain = self._chains.get(seq) if seq is not None else None
        if chain is None or chain.row != row:
            raise NotImplementedError("copy_slots: source slots are not one branch of this row")
        depth = len(src)
        if src != chain.slots[:depth] or dst != list(range(chain.n_main, chain.n_main + depth)):
            raise NotImplementedError("copy_slots: slots must be a branch's head, copied in place")
        kv = self._kv[row]
        if kv[: chain.n_main] != chain.prefix:
            raise RuntimeError(f"copy_slots: row {row} changed below the branch point")  # a bug
        self.lib.seq_rm(self._ctx, row, chain.n_main, -1)
        del kv[chain.n_main :]
        self.lib.seq_cp(self._ctx, seq, row, chain.n_main, chain.n_main + depth)
        kv.extend(chain.tokens[:depth])

    def _alloc(self) -> int:
        if not self._free:
            raise UsageError(
                f"SSD fan-out needs more than the {self._ctx_seqs} sequences llama.cpp supports",
                "use fewer prompts per call or a smaller --fan-out",
            )
        return self._free.pop()

    def _drop_chains(self) -> None:
        for seq in self._chains:
            self.lib.seq_rm(self._ctx, seq, -1, -1)
            self._free.append(seq)
        self._free.sort(reverse=True)
        self._chains.clear()
        self._scratch.clear()
