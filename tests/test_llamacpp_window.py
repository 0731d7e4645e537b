"""Sliding-window models' rows in and out of the llama.cpp runner's prefix store, without
the compiled library: `FakeWindowLib` (support/fake_llamalib.py) scores a query from its
window's cells and fails when one is missing. llama.cpp may give a cell outside a
sequence's window to another sequence and then drops that sequence's positions up to it,
and llama.cpp saves a sliding layer's cells within the last position's window only, so a
saved state may start after position 0 (`Entry.first`); a state is cut only where the
window before the cut is all there (`StateStore.cuts_to`). The real library's run is
test_llamacpp_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.fake_llamalib import FakeWindowLib, window_logits

from ssdlocal.backends.base import Logits
from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
from ssdlocal.backends.llamacpp import loader as gguf_loader
from ssdlocal.backends.llamacpp.prefix import StateStore

W = 4
TOKENS = [(7 * i) % 200 + 5 for i in range(20)]


@pytest.fixture
def runner(monkeypatch, tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir["llama"])
    vocab = json.loads((tiny_dir["llama"] / "config.json").read_text())["vocab_size"]
    lib = FakeWindowLib(vocab, tokenizer, size=W)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.lib.LlamaLib", lambda verbose=False: lib)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: False)
    monkeypatch.setattr(gguf_loader, "gguf_tokenizer", lambda path: tokenizer)
    path = tmp_path / "target.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    r = LlamaCppRunner(load_gguf(str(path)))
    r.setup_prefix(1000)
    return lib, r


def stored(lib, r, spill: int = -1):
    """A row of TOKENS kept (its positions 0..spill given away by llama.cpp first)."""
    r.reset(1, 64)
    r.feed([TOKENS], Logits.NONE)
    if spill >= 0:
        lib.spill(lib.contexts[-1], 0, spill)
    r.store(0, TOKENS)
    (entry,) = r.prefix.entries.values()
    return entry


def test_a_state_is_cut_only_where_its_window_is_all_there(runner):
    """The saved state holds the last window only: a row takes the entry whole or all but
    its last token (whose window the state holds), and reads shorter prefixes again."""
    lib, r = runner
    assert r.window == W and not r.prefix.whole
    entry = stored(lib, r)
    assert entry.first == len(TOKENS) - W  # positions 16..19 saved
    r.reset(3, 64)  # a batch: rows take all they share
    last, below = TOKENS[:19] + [99], TOKENS[:16] + [98]  # a part at 19 (window 16..18), at 16 (13..15)
    assert r.reuse(0, last) == 19
    assert r.reuse(1, below) == 0  # position 15 is not in the state: read from the start
    assert r.reuse(2, TOKENS + [97]) == len(TOKENS)  # the whole entry
    rows = [last, below, TOKENS + [97]]
    out = r.feed([row[len(r.held[b]) :] for b, row in enumerate(rows)], Logits.LAST)
    for b, row in enumerate(rows):
        assert torch.equal(out[b][0], torch.from_numpy(window_logits("target.gguf", row, lib.vocab, W)))


def test_a_spilled_row_keeps_where_its_cells_start(runner):
    """A live row whose positions llama.cpp gave away past its last window keeps where its
    cells start (seq_pos_min) when that is later than the saved window's start."""
    lib, r = runner
    r.reset(1, 64)
    r.feed([TOKENS[:3]], Logits.NONE)
    r.store(0, TOKENS[:3])
    assert [e.first for e in r.prefix.entries.values()] == [0]  # shorter than the window: all of it
    r.forget_prefixes()
    entry = stored(lib, r, spill=16)  # position 16 is outside the window of the next token's
    assert entry.first == 17
    r.reset(2, 64)
    assert r.reuse(0, TOKENS[:19] + [99]) == 0  # its window 16..18 is not all there
    assert r.reuse(1, TOKENS + [97]) == len(TOKENS)
    out = r.feed([TOKENS[:19] + [99], [97]], Logits.LAST)
    for b, row in enumerate([TOKENS[:19] + [99], TOKENS + [97]]):
        assert torch.equal(out[b][0], torch.from_numpy(window_logits("target.gguf", row, lib.vocab, W)))


def test_without_the_rule_the_cut_state_misses_its_window(runner, monkeypatch):
    """The check above can fail: a state cut where its window is not saved scores a missing cell."""
    lib, r = runner
    stored(lib, r)
    monkeypatch.setattr(StateStore, "cuts_to", lambda self, first, n: True)
    r.reset(2, 64)
    assert r.reuse(1, TOKENS[:18] + [98]) == 18
    with pytest.raises(AssertionError, match="window lacks a cell"):
        r.feed([[], [98]], Logits.LAST)


def test_a_state_cut_nowhere_usable_is_not_kept_and_read_ahead_starts_again(runner):
    """A row whose kept tokens end where its window is not saved is not stored (no row
    could use its state); the reading sequence, when it cannot be cut where a prompt parts
    from it (its cells given away before the window), is read again from the start."""
    lib, r = runner
    r.reset(1, 64)
    r.feed([TOKENS + [1, 2, 3, 4, 5, 6, 7, 8]], Logits.NONE)
    r.store(0, TOKENS)  # the row's first 20 tokens: their last window is not in a saved state
    assert not r.prefix.entries
    r.reset(1, 64)
    assert r.read_ahead(TOKENS, len(TOKENS)) == len(TOKENS)
    lib.spill(lib.contexts[-1], r._read_seq, 9)
    other = TOKENS[:12] + [98, 97]
    assert r.read_ahead(other, 2) == 2  # not 14: the cut at 12 would miss position 9
    assert r._reading == other[:2]
    r.reset(1, 64)  # what was read ahead goes to the store, with where its saved cells start
    assert sorted(e.first for e in r.prefix.entries.values()) == [0, len(TOKENS) - W]
