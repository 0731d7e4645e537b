"""A fake LlamaLib (backends/llamacpp/lib.py) with llama.cpp's KV-cache semantics: unified
cells carrying sequence ids, seq_rm / seq_cp by position ranges, batch position checks,
and logits that are a pure function of the tokens a query can see. A stale or missing
cell changes the logits or trips an assertion, so tests of the runner's bookkeeping run
without the compiled library. `FakeRecurrentLib` adds a hybrid model's recurrent state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class FakeCtx:
    def __init__(self, model, n_ctx, n_batch, n_seq_max):
        self.model, self.n_ctx, self.n_batch, self.n_seq_max = model, n_ctx, n_batch, n_seq_max
        self.cells: list[dict] = []  # {"pos", "token", "seqs": set}
        self.decoded = 0
        self.freed = False


class FakeLlamaLib:
    """llama.cpp's memory semantics in Python; model `path` picks the logits function."""

    extra_bufts = True  # LlamaLib's: weights repacked for the CPU

    def __init__(self, vocab: int, tokenizer=None, max_seq: int = 64) -> None:
        self.vocab, self.tokenizer, self.max_seq = vocab, tokenizer, max_seq
        self.contexts: list[FakeCtx] = []
        self.rm_calls: list[tuple[int, int, int]] = []
        self.freed_models: list[str] = []

    # models
    def supports_gpu(self) -> bool:
        return False

    def max_sequences(self) -> int:
        return self.max_seq

    def load_model(self, path, n_gpu_layers, main_gpu):
        return Path(path).name

    def free_model(self, model) -> None:
        self.freed_models.append(model)

    def n_vocab(self, model) -> int:
        return self.vocab

    def n_ctx_train(self, model) -> int:
        return 4096

    def meta(self, model, key):
        return "fake"

    def window(self, model) -> int:
        return 0

    def recurrent(self, model) -> bool:
        return False

    def tokenize(self, model, text):
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # contexts
    def new_context(self, model, n_ctx, n_batch, n_seq_max, n_threads, *, flash_attn=None, snapshots=0):
        ctx = FakeCtx(model, n_ctx, n_batch, n_seq_max)
        ctx.flash_attn = flash_attn
        self.contexts.append(ctx)
        return ctx

    def free_context(self, ctx) -> None:
        ctx.freed = True

    def set_threads(self, ctx, n) -> None:
        pass

    def clear(self, ctx) -> None:
        ctx.cells = []

    def seq_rm(self, ctx, seq, p0, p1) -> bool:
        self.rm_calls.append((seq, p0, p1))
        hi = p1 if p1 >= 0 else 1 << 30
        lo = max(p0, 0)
        for c in ctx.cells:
            if (seq < 0 or seq in c["seqs"]) and lo <= c["pos"] < hi:
                c["seqs"].discard(seq) if seq >= 0 else c["seqs"].clear()
        ctx.cells = [c for c in ctx.cells if c["seqs"]]
        return True

    def seq_pos_min(self, ctx, seq) -> int:
        have = [c["pos"] for c in ctx.cells if seq in c["seqs"]]
        return min(have) if have else -1

    def seq_cp(self, ctx, src, dst, p0, p1) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        for c in ctx.cells:
            if src in c["seqs"] and max(p0, 0) <= c["pos"] < hi:
                c["seqs"].add(dst)

    def seq_state(self, ctx, seq, partial=False) -> bytes:
        return json.dumps([(c["pos"], c["token"]) for c in ctx.cells if seq in c["seqs"]]).encode()

    def set_seq_state(self, ctx, seq, data, partial=False) -> None:
        cells = json.loads(data)
        assert not ctx.freed and len(ctx.cells) + len(cells) <= ctx.n_ctx, "KV cache full"
        ctx.cells += [{"pos": p, "token": t, "seqs": {seq}} for p, t in cells]

    def decode(self, ctx, tokens, positions, seqs, want, n_vocab):
        assert not ctx.freed and len(tokens) <= ctx.n_batch
        assert len(ctx.cells) + len(tokens) <= ctx.n_ctx, "KV cache full"
        next_pos: dict[int, int] = {}
        for tok, pos, seq in zip(tokens, positions, seqs):
            assert 0 <= seq < ctx.n_seq_max and 0 <= tok < self.vocab
            if seq not in next_pos:  # llama.cpp: batch positions continue the sequence
                have = [c["pos"] for c in ctx.cells if seq in c["seqs"]]
                next_pos[seq] = max(have) + 1 if have else 0
            assert pos == next_pos[seq], f"seq {seq}: position {pos}, expected {next_pos[seq]}"
            next_pos[seq] += 1
            ctx.cells.append({"pos": pos, "token": tok, "seqs": {seq}})
        rows = []
        for (tok, pos, seq), w in zip(zip(tokens, positions, seqs), want):
            seen = self.visible(ctx, seq, pos)
            if w:
                rows.append(model_logits(ctx.model, seen, self.vocab))
        ctx.decoded += len(tokens)
        return np.stack(rows).astype(np.float32) if rows else np.empty((0, n_vocab), np.float32)

    def visible(self, ctx, seq: int, pos: int) -> list[int]:
        """The tokens a query of `seq` at `pos` scores from: all before it, each present."""
        seen = sorted((c["pos"], c["token"]) for c in ctx.cells if seq in c["seqs"] and c["pos"] <= pos)
        assert [p for p, _ in seen] == list(range(pos + 1)), f"seq {seq} sees {seen}"
        return [t for _, t in seen]


def model_logits(model: str, tokens: list[int], vocab: int) -> np.ndarray:
    """A 'model': a bigram table plus noise hashed from the whole visible context; the
    draft ("draft*.gguf") shares the table with smaller, different noise."""
    table = np.random.default_rng(1234).standard_normal((vocab, vocab)).astype(np.float32)
    is_draft = model.startswith("draft")
    noise_rng = np.random.default_rng([hash(tuple(tokens)) & 0xFFFFFFFF, 7 if is_draft else 3])
    noise = noise_rng.standard_normal(vocab)
    return (2.0 * table[tokens[-1]] + (0.2 if is_draft else 0.6) * noise).astype(np.float32)


def reference_greedy(model: str, prompt: list[int], n: int, vocab: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(model_logits(model, seq, vocab))))
    return seq[len(prompt) :]


class FakeRecurrentLib(FakeLlamaLib):
    """A hybrid model's memory (llama.cpp's llama_memory_hybrid in miniature): beside the
    attention cells, each sequence has one recurrent state, the tokens it absorbed. A
    decode checks that the state holds exactly the tokens the query's cells hold before
    it (a wrong cut fails there), and scores from the state. seq_rm cannot drop a state's
    tail, except by llama.cpp's snapshots (`snapshots` > 0): the last decode call's
    states, one rollback of at most `snapshots` tokens before the next decode; a rollback
    past that call's tokens gives a stale state, as in llama.cpp. seq_cp copies a state
    whole whatever the range; a partial sequence state is the recurrent state alone."""

    def recurrent(self, model) -> bool:
        return True

    def new_context(self, model, n_ctx, n_batch, n_seq_max, n_threads, *, flash_attn=None, snapshots=0):
        ctx = super().new_context(model, n_ctx, n_batch, n_seq_max, n_threads, flash_attn=flash_attn)
        ctx.snapshots = snapshots
        ctx.states = {}  # seq -> tuple of absorbed tokens
        ctx.snaps = {}  # seq -> states after each token of its last decode call, newest last
        ctx.pending = set()  # sequences whose snapshots were used since their last decode
        return ctx

    def seq_rm(self, ctx, seq, p0, p1) -> bool:
        if seq >= 0 and not (p0 <= 0 and p1 < 0):
            state = ctx.states.get(seq, ())
            if 0 < p0 <= len(state) - 1:  # the tail of the state: a rollback or nothing
                back = len(state) - p0
                if not ctx.snapshots or back > ctx.snapshots or seq in ctx.pending:
                    return False
                snaps = ctx.snaps.get(seq, [])
                ctx.states[seq] = snaps[-1 - back] if back < len(snaps) else ("stale",) + state[:p0]
                ctx.pending.add(seq)
        elif seq >= 0:
            ctx.states.pop(seq, None)
            ctx.snaps.pop(seq, None)
        else:
            ctx.states.clear()
        return super().seq_rm(ctx, seq, p0, p1)

    def seq_cp(self, ctx, src, dst, p0, p1) -> None:
        super().seq_cp(ctx, src, dst, p0, p1)
        ctx.states[dst] = ctx.states.get(src, ())

    def seq_state(self, ctx, seq, partial=False) -> bytes:
        if partial:
            return json.dumps(list(ctx.states.get(seq, ()))).encode()
        cells = json.loads(super().seq_state(ctx, seq))
        return json.dumps({"cells": cells, "state": list(ctx.states.get(seq, ()))}).encode()

    def set_seq_state(self, ctx, seq, data, partial=False) -> None:
        saved = json.loads(data)
        if partial:
            ctx.states[seq] = tuple(saved)
        else:
            super().set_seq_state(ctx, seq, json.dumps(saved["cells"]).encode())
            ctx.states[seq] = tuple(saved["state"])
        ctx.snaps.pop(seq, None)

    def decode(self, ctx, tokens, positions, seqs, want, n_vocab):
        for seq in set(seqs):
            seen = sorted((c["pos"], c["token"]) for c in ctx.cells if seq in c["seqs"])
            have = tuple(t for _, t in seen)
            assert ctx.states.get(seq, ()) == have, f"seq {seq}: state {ctx.states.get(seq)} but cells {have}"
        super().decode(ctx, tokens, positions, seqs, [False] * len(tokens), n_vocab)  # cells and checks
        rows = []
        steps: dict[int, list] = {}
        for tok, seq, w in zip(tokens, seqs, want):
            ctx.states[seq] = ctx.states.get(seq, ()) + (int(tok),)
            steps.setdefault(seq, []).append(ctx.states[seq])
            if w:
                rows.append(model_logits(ctx.model, list(ctx.states[seq]), self.vocab))
        for seq, states in steps.items():
            ctx.snaps[seq] = states[-(ctx.snapshots + 1) :]
            ctx.pending.discard(seq)
        return np.stack(rows).astype(np.float32) if rows else np.empty((0, n_vocab), np.float32)


class FakeWindowLib(FakeLlamaLib):
    """A sliding-window model's memory (every layer sees the last `size` positions): a
    query scores from its window's tokens and fails when a cell of it is missing; a saved
    state holds the last position's window only, as llama.cpp's does. `spill`
    does to a sequence what llama.cpp's cell reuse does: a cell outside its window given to
    another sequence, and the sequence's positions up to it dropped (llama.cpp keeps each
    sequence's positions contiguous)."""

    def __init__(self, vocab: int, tokenizer=None, max_seq: int = 64, size: int = 4) -> None:
        super().__init__(vocab, tokenizer, max_seq)
        self.size = size

    def window(self, model) -> int:
        return self.size

    def seq_state(self, ctx, seq, partial=False) -> bytes:
        """As llama.cpp saves a sliding-window layer: the cells within the window of the
        sequence's last position only."""
        cells = json.loads(super().seq_state(ctx, seq))
        top = max((p for p, _ in cells), default=-1)
        return json.dumps([(p, t) for p, t in cells if p > top - self.size]).encode()

    def spill(self, ctx, seq: int, upto: int) -> None:
        top = max(c["pos"] for c in ctx.cells if seq in c["seqs"])
        assert upto <= top + 1 - self.size, "llama.cpp reuses only cells outside the window"
        for c in ctx.cells:
            if seq in c["seqs"] and c["pos"] <= upto:
                c["seqs"].discard(seq)
        ctx.cells = [c for c in ctx.cells if c["seqs"]]

    def visible(self, ctx, seq: int, pos: int) -> list[int]:
        seen = {c["pos"]: c["token"] for c in ctx.cells if seq in c["seqs"] and c["pos"] <= pos}
        need = range(max(0, pos - self.size + 1), pos + 1)
        assert all(p in seen for p in need), f"seq {seq} at {pos}: its window lacks a cell ({sorted(seen)})"
        return [seen[p] for p in need]


def window_logits(model: str, tokens: list[int], vocab: int, size: int) -> np.ndarray:
    """FakeWindowLib's logits after `tokens`: those of its last `size`."""
    return model_logits(model, tokens[-size:], vocab)
