"""SSD tree decoding on a llama.cpp context: each branch is a llama.cpp sequence of its own.

`forward_raw` maps each tree branch to its own sequence: the row's prefix cells are shared
with it by seq_cp (no data copy), its own tokens are decoded in one llama_batch per step
with every other branch, and `take_branch` hands an accepted branch's cells back to the
row (seq_cp). A mixin of LlamaCppRunner (backends/llamacpp/runner.py), whose context,
rows (`_kv`, `held`), `_decode`, `_reconcile` and free sequences it uses. A recurrent
model's branch gets the row's state where it starts (recurrent.py's `_state_into`: shared
when it starts at the row's end, else the row's checkpoint and the tokens after it decoded
into the branch), and an adopted branch replaces the row's sequence whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ssdlocal.backends.base import kept_logits
from ssdlocal.core.errors import UsageError


@dataclass
class _Chain:
    """One tree branch: llama.cpp sequence `seq` = row's first n_main tokens + own tokens."""

    row: int
    n_main: int
    prefix: list[int]  # the row's tokens 0..n_main-1 when the branch was made
    slots: list[int] = field(default_factory=list)  # scratch slots written, in order
    tokens: list[int] = field(default_factory=list)  # their tokens


class TreeSequences:
    """Runner.forward_raw / take_branch / tree_width over llama.cpp sequences."""

    # set by LlamaCppRunner
    lib: object
    num_slots: int
    vocab_size: int
    held: list[list[int]]
    _ctx: object
    _ctx_seqs: int
    _kv: list[list[int]]
    _chains: dict[int, _Chain]
    _scratch: dict[tuple[int, int], int]
    _free: list[int]
    _touched: set[int]
    recurrent: bool

    def forward_raw(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runner.forward_raw for tree masks; does not touch `held`.

        ids, positions, slots [B, T] long; mask [B, T, S] bool. Query (b, t) writes slot
        slots[b, t] and may see a prefix 0..n-1 of row b's cached tokens plus the scratch
        slots one earlier branch wrote (its chain). The last slot is the trash slot of
        padded queries (skipped; their logits are zeros). Returns [B, T, V] float32 (or
        `out`, Runner.forward_raw).
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
        found = torch.zeros(batch, width, self.vocab_size)  # [B, T, V]
        if not plan:
            return kept_logits(found, out)
        logits = self._decode(
            [ids_l[b][t] for b, t, _, _ in plan],
            [pos_l[b][t] for b, t, _, _ in plan],
            [seq for _, _, _, seq in plan],
        )  # [N, V]
        for i, (b, t, chain, seq) in enumerate(plan):
            found[b, t] = torch.from_numpy(logits[i])
            chain.slots.append(slot_l[b][t])
            chain.tokens.append(ids_l[b][t])
            self._chains[seq] = chain
            self._scratch[(b, slot_l[b][t])] = seq
        return kept_logits(found, out)

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
            if self.recurrent:
                self._state_into(b, seq, n_main)
            else:
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
        if self.recurrent:  # the branch's state is at its end: it replaces the row whole
            self.lib.seq_rm(self._ctx, row, -1, -1)
            self.lib.seq_cp(self._ctx, seq, row, -1, -1)
            del kv[chain.n_main :]
            kv.extend(chain.tokens)
            self._spans.pop(row, None)
            self._cut(row, chain.n_main + depth)
            return
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
        seq = self._free.pop()
        self._touched.add(seq)  # cells may stay here if a decode fails: reset empties it
        return seq

    def _drop_chains(self) -> None:
        for seq in self._chains:
            self.lib.seq_rm(self._ctx, seq, -1, -1)
            self._free.append(seq)
        self._free.sort(reverse=True)
        self._chains.clear()
        self._scratch.clear()
