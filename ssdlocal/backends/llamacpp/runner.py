"""LlamaCppRunner: the Runner protocol (backends/base.py) over a llama.cpp context.

Row b of a batch is llama.cpp sequence b in one unified KV cache. `held[b]` means what
it means for every runner (tokens of row b whose keys/values are cached); `sync` only
shortens it, so before touching row b the runner removes the cache cells past the
common prefix of `held[b]` and what it really wrote (`_kv[b]`) with
llama_memory_seq_rm. SSD tree decoding (`forward_raw`,
backends/llamacpp/tree.py) maps each branch to a sequence of its own. With the model
loaded `batch_invariant`, decode steps go in the call widths of backends/llamacpp/alike.py,
a lone token padded in a scratch sequence of its own. The prefix store keeps saved
sequence states outside the context (backends/llamacpp/stored.py), so a row alone in its
call holds cells 0, 1, ... for its positions, read cold or restored. A recurrent or hybrid
model's rows are cut back through backends/llamacpp/recurrent.py (llama.cpp cannot drop a
recurrent tail), and its context holds only the sequences it uses (each keeps a state).
Knows nothing about speculation beyond the slot/mask pattern of forward_raw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from ssdlocal.backends.base import HeldRows, Logits
from ssdlocal.backends.llamacpp.alike import REPACKED, WIDEST, beside_pad, plan_calls, widest_alike
from ssdlocal.backends.llamacpp.prefix import StateStore
from ssdlocal.backends.llamacpp.recurrent import SNAPSHOTS, Checkpoint, RecurrentRows, Span
from ssdlocal.backends.llamacpp.stored import PAD as _PAD
from ssdlocal.backends.llamacpp.stored import StoredRows
from ssdlocal.backends.llamacpp.tree import TreeSequences, _Chain
from ssdlocal.core.errors import UsageError

N_BATCH = 512  # most tokens per llama_decode call (llama.cpp's n_batch == n_ubatch)
# A lone row without a prefix store starts in a context of at most this many cells and
# moves to one twice as large when it fills it (_grow): a call that may run to the end of
# a 32k context (generate without --max-new-tokens) no longer allocates and clears its
# whole KV cache first (1.5B Q4_K_M, 2-core EPYC: 0.75 s to the first token and 0.9 GB).
GROW_FROM = 4096
# A recurrent model's context allocates a state per sequence (with SNAPSHOTS more for
# rollbacks): it holds its rows, the reading sequence, and for a tree runner this many
# branch sequences, not llama.cpp's 256.
RECURRENT_BRANCHES = 64


class LlamaCppRunner(StoredRows, TreeSequences, RecurrentRows, HeldRows):
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
        self._grows_to = 0  # a lone row's context may grow to this many cells (_grow); 0: it does not
        self._ctx_seqs = 0
        self._ctx_threads = 0
        self._n_batch = N_BATCH
        self._kv: list[list[int]] = []  # per row: tokens really in sequence b
        self._lengths: list[int] = []  # per row: cached tokens while decoding with `step`
        self._step_base: list[int] = []  # per row: cached tokens at begin_steps
        self._chains: dict[int, _Chain] = {}  # branch sequence id -> chain
        self._scratch: dict[tuple[int, int], int] = {}  # (row, slot) -> branch sequence id
        self._free: list[int] = []
        self._touched: set[int] = set()  # branch sequences used since the last reset
        self._store_tokens = 0  # the prefix store's cells (setup_prefix), and the context's room to read ahead
        self.prefix: StateStore | None = None  # earlier calls' rows, as saved sequence states
        self._read_seq = -1  # with a store: the sequence a waiting prompt is read ahead into
        self._reading: list[int] = []  # the tokens it holds
        self._exact: list[int] = []  # per row: leading cells a cold read reproduces (a lone row's)
        self.alike = loaded.batch_invariant  # steps in alike call widths (alike.py)
        self.alike_width = 0  # the widest alike step call on this machine; 0: not checked yet
        self._pad_seq = self._check_seq = -1  # alike: scratch sequences (pads, the width check)
        self.window = loaded.window  # sliding-window layers: stored states are cut within reach (stored.py)
        self.recurrent = loaded.recurrent  # rows are cut through recurrent.py
        self._snapshots = SNAPSHOTS if self.recurrent and not tree else 0  # a tree's rows go back further
        self._checkpoints: dict[int, Checkpoint] = {}
        self._spans: dict[int, Span] = {}
        self._singles: dict[int, bool] = {}
        self._marks: dict[int, Checkpoint] = {}  # alike's scratch sequences (_remove_from)
        self.rollbacks = dict.fromkeys(("snapshot", "checkpoint", "scratch", "again"), 0)  # recurrent.py's cuts

    # ------------------------------------------------------------------ lifecycle
    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows; (re)create the context when it is too small. With a prefix store
        the context keeps room beside the rows (the store's size) to read waiting prompts
        ahead; what was read ahead goes to the store first. When the rows need more cells
        than the context has, but leave the reading room at least half of its cells, the
        room shrinks instead of a new context being made (seconds for a large one): a
        request joining a serving batch does not stall the rows already running."""
        max_seqs = self.lib.max_sequences()
        scratch = 2 if self.alike else 0  # the pad and the width check's sequences
        if (max_seqs if self.tree else batch_size) < batch_size or batch_size + scratch > max_seqs:
            raise UsageError(
                f"llama.cpp supports at most {max_seqs - scratch} parallel sequences here, asked for {batch_size} rows",
                "use fewer prompts per call",
            )
        self._put_reading()
        reading = 1 if self._store_tokens and batch_size + scratch < max_seqs else 0
        # all of them: a new batch size keeps the context
        seqs = max_seqs if self.tree or reading or scratch else batch_size
        if self.recurrent:  # each sequence costs a state: the ones used
            seqs = min(max_seqs, batch_size + reading + scratch + (RECURRENT_BRANCHES if self.tree else 0))
        row_cells, room = batch_size * num_slots, self._store_tokens if reading else 0
        cells = -(-(row_cells + room) // _PAD) * _PAD
        self._grows_to = 0
        if batch_size == 1 and not (self.tree or self.alike or room) and cells > GROW_FROM:
            self._grows_to, cells = cells, GROW_FROM  # one row's cells move as a block (_grow)
        spare = self._ctx_cells - row_cells - _PAD  # the reading room this context leaves
        if self._ctx is None or seqs > self._ctx_seqs or (cells > self._ctx_cells and spare < room // 2):
            self.close()
            if self._ctx_cells:  # growing: leave room, so the context is not made again at every step
                cells = max(cells, min(2 * self._ctx_cells, cells + room))
            self._open(cells, seqs)
        else:
            self._drop_chains()
            # only rows (below the last batch's size), branches and the reading sequence hold
            # cells: a seq_rm of each of a context's 256 sequences would scan every cell 256 times
            used = set(range(max(len(self.held), batch_size))) | self._touched
            for seq in sorted(used):
                self.lib.seq_rm(self._ctx, seq, -1, -1)
        self._touched = set()
        self._checkpoints.clear()
        self._spans.clear()
        self._singles.clear()
        self._read_seq = self._ctx_seqs - 1 if reading else -1
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self._count_end()
        self._kv = [[] for _ in range(batch_size)]
        self._exact = [0] * batch_size
        self._chains.clear()
        self._scratch.clear()
        first_reserved = self._read_seq if reading else self._ctx_seqs
        if scratch:
            self._pad_seq, self._check_seq = first_reserved - 1, first_reserved - 2
        self._free = list(range(first_reserved - 1 - scratch, batch_size - 1, -1))  # pop() gives the lowest

    def graph_report(self, since: dict | None = None) -> dict:
        """Runner.graph_report: llama.cpp captures nothing of ours."""
        return {"mode": "off", **dict.fromkeys(("captured", "replays", "eager", "refused", "dropped", "evicted"), 0)}

    def warm_up(self, batch_size: int, widths, at_widths=()) -> int:
        """Runner.warm_up: nothing to capture (llama.cpp sizes its context per call)."""
        return 0

    def close(self) -> None:
        if self._ctx is not None:
            self.lib.free_context(self._ctx)
            self._ctx = None
        self._reading = []  # its cells went with the context (the store is kept apart)

    def __del__(self) -> None:  # the model outlives contexts; free ours first
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def _want_threads(self) -> int:
        # the CPU placement (placement.py) sets torch's thread count for each process
        return self.threads or max(1, torch.get_num_threads())

    # ------------------------------------------------------------------ rows
    def _reconcile(self, row: int) -> bool:
        """Drop cells of sequence `row` past the common prefix of held[row] and _kv[row]
        (a recurrent model's: recurrent.py's cut); whether any went."""
        kv, held = self._kv[row], self.held[row]
        n = min(len(kv), len(held))
        if kv[:n] != held[:n]:
            n = next(i for i in range(n) if kv[i] != held[i])
        cut = n < len(kv)
        if cut and self.recurrent:
            self._cut(row, n)
        elif cut:
            self.lib.seq_rm(self._ctx, row, n, -1)
            del kv[n:]
        if len(held) > n:
            raise RuntimeError(f"row {row}: held tokens that were never fed to llama.cpp")  # a bug
        return cut

    def _decode(self, tokens, positions, seqs, want=None, progress=None) -> np.ndarray:
        """Decode in chunks of n_batch; float32 logits [N wanted, V] for the tokens whose
        `want` flag is set (default: every token). `progress(done, total)` after each chunk
        (tokens of the whole batch); an exception it raises stops the decode."""
        threads = self._want_threads()
        if threads != self._ctx_threads:
            self.lib.set_threads(self._ctx, threads)
            self._ctx_threads = threads
        want = [True] * len(tokens) if want is None else want
        if self._grows_to and positions and max(positions) >= self._ctx_cells:
            self._grow(max(positions) + 1)
        if self.alike:
            return self._decode_alike(tokens, positions, seqs, want, progress)
        out = []
        step = self._n_batch
        for i in range(0, len(tokens), step):
            sl = slice(i, i + step)
            out.append(self._decode_call(tokens[sl], positions[sl], seqs[sl], want[sl]))
            if progress is not None:
                progress(min(i + step, len(tokens)), len(tokens))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _grow(self, need: int) -> None:
        """A lone row (sequence 0) needs `need` cells, more than its context has: a context
        twice as large (at least `need`, at most what reset asked for) takes its cells,
        saved and restored by llama.cpp's sequence state. They land in the same cells,
        0 to n-1, so every later logit is what the larger context would have given."""
        cells = min(self._grows_to, -(-max(need, 2 * self._ctx_cells) // _PAD) * _PAD)
        saved = self.lib.seq_state(self._ctx, 0)
        self.close()
        self._open(cells, self._ctx_seqs)
        self.lib.set_seq_state(self._ctx, 0, saved)
        self._spans.pop(0, None)  # llama.cpp's snapshots stayed in the old context

    def _open(self, cells: int, seqs: int) -> None:
        """A new context of `cells` cells for `seqs` sequences (the old one closed)."""
        self._n_batch = min(N_BATCH, cells)
        # no flash attention on a CPU: measured on the 1.5B Q4_K_M pair (2-core EPYC,
        # AVX-512), 28 new tokens after 2,105 took 0.84-0.94 s with llama.cpp's auto choice
        # (on) and 0.50-0.55 s without; one-token steps and cold prompts no slower
        self._ctx = self.lib.new_context(
            self.model,
            cells,
            self._n_batch,
            seqs,
            self._want_threads(),
            flash_attn=False if self.device.type == "cpu" else None,
            snapshots=self._snapshots,
        )
        self._ctx_cells, self._ctx_seqs = cells, seqs
        self._ctx_threads = self._want_threads()

    def _decode_alike(self, tokens, positions, seqs, want, progress) -> np.ndarray:
        """_decode with steps in alike widths (backends/llamacpp/alike.py)."""
        width = self._alike()
        found: dict[int, np.ndarray] = {}
        done = 0
        for call in plan_calls(seqs, want, width, self._n_batch):
            ix = call.index
            args = (
                [int(tokens[i]) for i in ix],
                [positions[i] for i in ix],
                [seqs[i] for i in ix],
                [want[i] for i in ix],
            )
            if call.pad:
                got = beside_pad(self._decode_call, self._remove_from, self._pad_seq, *args)
            else:
                got = self._decode_call(*args)
            found.update(zip([i for i in ix if want[i]], got))
            done += len(ix)
            if progress is not None:
                progress(done, len(tokens))
        rows = [found[i] for i in range(len(tokens)) if want[i]]
        return np.stack(rows) if rows else np.empty((0, self.vocab_size), np.float32)

    def _alike(self) -> int:
        """The widest alike step call, checked once on this runner's first decode."""
        if not self.alike_width:
            guess = REPACKED if self.lib.extra_bufts else WIDEST
            self.alike_width = widest_alike(
                self._decode_call, self._remove_from, guess, self._check_seq, self._pad_seq, self.vocab_size
            )
            if not self.alike_width:
                raise UsageError(
                    "llama.cpp on this machine gives a token other logits in a call of two tokens "
                    "than alone, even beside a pad token: --batch-invariant cannot hold here",
                    "drop --batch-invariant (SD and SSD then match AR except at near-ties), or run "
                    "the target with --target-backend torch",
                )
        return self.alike_width

    def _decode_call(self, tokens: list[int], positions: list[int], seqs: list[int], want: list[bool]) -> np.ndarray:
        """One llama_decode on this runner's context (alike.Decode)."""
        out = self.lib.decode(self._ctx, tokens, positions, seqs, want, self.vocab_size)
        if self.recurrent:
            self._after_call(positions, seqs)
        return out

    def _remove_from(self, seq: int, p0: int) -> None:
        """Drop sequence `seq`'s cells from position p0 on (alike.Remove). A recurrent
        model's scratch sequence cannot lose a tail: the first call at p0 > 0 (the width
        check's, when the sequence ends there) saves its state, later ones set it back and
        drop the attention cells past it, which stay where they were."""
        if not self.recurrent or p0 == 0:
            self.lib.seq_rm(self._ctx, seq, p0 if p0 else -1, -1)
            self._marks.pop(seq, None)
            return
        mark = self._marks.get(seq)
        if mark is None or mark.position != p0:
            self._marks[seq] = Checkpoint(p0, self.lib.seq_state(self._ctx, seq, partial=True))
            return
        self.lib.set_seq_state(self._ctx, seq, mark.state, partial=True)
        self.lib.seq_rm(self._ctx, seq, p0, -1)

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
            cut = self._reconcile(b)
            start = len(self.held[b])
            if start + len(r) > self.num_slots:
                raise RuntimeError("KV cache too small for this step")  # engine sizes it; a bug
            if self.recurrent:
                self._before_decode(b, len(r), cut)
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
                if r and self.recurrent:  # and the state it moved
                    self._restore(b, len(self._kv[b]))
                elif r:
                    self.lib.seq_rm(self._ctx, b, len(self._kv[b]), -1)
            raise
        per_row = {Logits.ALL: None, Logits.LAST: 1, Logits.NONE: 0}[logits]
        result = []
        offset = 0
        canonical = self._lone() and self._n_batch == N_BATCH  # chunks at multiples of N_BATCH
        for b, r in enumerate(rows):
            n = len(r) if per_row is None or not r else per_row
            result.append(out[offset : offset + n])
            offset += n
            if r:
                start = len(self._kv[b])
                if canonical and self._exact[b] == start and start % N_BATCH == 0:
                    self._exact[b] = start + len(r) // N_BATCH * N_BATCH  # whole chunks, as a cold read has them
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

    def step(self, ids: torch.Tensor, bound: int | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] at positions lengths..lengths+T-1 of each row -> logits [B, T, V];
        `at` [B]: row b decodes its ids up to column at[b] only, and llama.cpp computes
        the logits of that token alone -> [B, V] (Runner.step). A finished row that a last
        round took past its budget is fed only what its slots still hold: its padding is
        never read, and its missing logits are zeros."""
        rows = ids.tolist()
        for b, held in enumerate(self.held):
            del held[self._lengths[b] :]  # rejected tokens of the last step
        rows = [row[: max(0, self.num_slots - length)] for row, length in zip(rows, self._lengths)]
        if at is None:
            width = ids.shape[1]
            out = self.feed(rows)
            return torch.stack([torch.nn.functional.pad(o, (0, 0, 0, width - len(o))) for o in out])  # [B, T, V]
        cut = [row[: int(i) + 1] for row, i in zip(rows, at.tolist())]
        return torch.cat(self.feed(cut, Logits.LAST))  # [B, V]

    def advance(self, n, host: Sequence[int] | None = None) -> None:
        """lengths += n (a [B] tensor or one int for every row; `host`: the same on the host)."""
        values = host if host is not None else n.tolist() if isinstance(n, torch.Tensor) else [n] * len(self._lengths)
        self._lengths = [length + int(k) for length, k in zip(self._lengths, values)]
        self._count_advance(n, values)
