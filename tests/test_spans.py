"""How many KV slots a step reads: decode spans in eighths of a doubling, SSD tree steps
bounded by the longest row (not by every slot the call may use), with the same tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ssdlocal.backends.torch import decode_state
from ssdlocal.core.config import EngineConfig, ModelSpec, SamplingParams
from ssdlocal.draft.ssd.protocol import StartMsg
from ssdlocal.draft.ssd.speculator import Speculator
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.mark.parametrize("needed", [1, 255, 300, 1100, 2049, 5000, 16000, 16385, 30000])
def test_a_decode_span_reads_at_most_an_eighth_more_than_it_needs(needed):
    span = decode_state.bucket_span(needed)
    assert needed <= span <= needed + max(255, needed // 8)
    assert span % decode_state.SLOT_ROUNDING == 0


def test_span_buckets_stay_few():
    shapes = {decode_state.bucket_span(n) for n in range(1, 32769)}
    assert len(shapes) == 40  # 16 up to 4,096 slots, then 8 per doubling
    assert {decode_state.bucket_span(n) for n in range(4000, 4600)} == {4096, 4608}


def _speculator(runner, prompt, num_slots) -> Speculator:
    msg = StartMsg(
        (tuple(prompt),),
        SamplingParams(),
        3,
        num_slots,
        runner.vocab_size,
        (2, 2, 1, 1),
        (2, 2, 1, 1),
        1.0,
        "jit",
        None,
    )
    return Speculator(runner, msg)


def test_tree_steps_attend_over_the_longest_row_with_the_same_branches(tiny_dir, monkeypatch):
    prompt = [(7 * i) % 300 + 5 for i in range(40)]
    with Engine(
        EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), prefix_cache_tokens=0)
    ) as engine:
        runner = engine.runner
        spans: list[int] = []
        real = runner.forward_raw

        def watched(ids, positions, slots, mask, out=None):
            spans.append(mask.shape[-1])
            return real(ids, positions, slots, mask, out)

        monkeypatch.setattr(runner, "forward_raw", watched)
        runs = {}
        for name in ("bounded", "fixed"):
            if name == "fixed":
                monkeypatch.setattr(runner, "tree_span", lambda needed: None)  # the old layout
            spans.clear()
            sp = _speculator(runner, prompt, num_slots=900)
            sp.first()
            sp.prespeculate()
            runs[name] = (list(spans), sp, {key: sp.cache.get(*key) for key in sp.cache.keys()})
    (bounded, sp_b, got_b), (fixed, sp_f, got_f) = runs["bounded"], runs["fixed"]
    full = sp_f.full_layout.total
    needed = len(sp_b.rows[0].seq) + 3 + 2 + sp_b.full_layout.branches * 3 + 1  # rows, proposal, tree, trash
    assert fixed and set(fixed) == {full}  # every slot of the call
    assert bounded and set(bounded) == {needed} and needed < full / 4
    assert got_b.keys() == got_f.keys() and got_b
    for key, branch in got_b.items():  # the same branches wherever their scratch slots are
        assert branch.tokens == got_f[key].tokens
        assert torch.allclose(branch.logits, got_f[key].logits, atol=1e-5, rtol=1e-5)


def test_tree_steps_keep_the_real_branches_logits_without_copies_per_step(tiny_dir):
    """Under graphs a tree step's logits are a static buffer: the speculator has each
    step's logits of its real branches written into one [B, W, K, V] buffer
    (Runner.forward_raw's `out`), where it used to clone the whole padded [B, W, V] every
    step and stack them all after (about 2.5 GB per round at B=8, W=64, V=152k)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab, self.made = vocab, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            tree = isinstance(out, torch.Tensor) and out.dim() >= 3 and out.shape[-1] == self.vocab  # [B, W, (K,) V]
            if name in ("clone", "stack", "cat") and tree:
                self.made.append((name, tuple(out.shape)))
            return out

    prompt = [(7 * i) % 300 + 5 for i in range(40)]
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), prefix_cache_tokens=0)
    trees = {}
    for graphs in ("off", "trace"):
        with Engine(replace(config, graphs=graphs)) as engine:
            sp = _speculator(engine.runner, prompt, num_slots=900)
            sp.first()
            sp.prespeculate()  # captures the tree steps (and checks their first replays)
            copies = Copies(engine.runner.vocab_size)
            with copies:
                sp.prespeculate()
            trees[graphs] = {key: sp.cache.get(*key) for key in sp.cache.keys()}
            if graphs == "trace":
                assert engine.runner.graphs.stats.replays > 0
                assert copies.made == [], copies.made
    assert trees["trace"].keys() == trees["off"].keys() and trees["trace"]
    for key, branch in trees["trace"].items():
        assert branch.tokens == trees["off"][key].tokens
        assert torch.allclose(branch.logits, trees["off"][key].logits, atol=1e-5)
