"""Sliding windows in SSD's tree steps (models/base.py: CausalLM's windowed masks come from
the position each cache slot holds, `slot_positions`, not from the slot's index): for every
family with windowed layers, branches decoded one depth per step in scratch slots far from
their positions, deeper than the window, give the logits of decoding each branch alone;
a branch copied back to the row's slots continues as the linear sequence would; and SSD
with the target as its own draft, its trees decoded to a depth past the window, accepts
every drafted token (the speculations it serves come from those tree steps)."""

from __future__ import annotations

import pytest
import torch
from support.drafts import draft_of
from support.tiny_families import FAMILIES
from support.tiny_models import build_tokenizer

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import causal_mask
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

WINDOWED = ["gemma3", "gemma4", "gpt_oss"]  # window 8 in their tiny checkpoints
PROMPT = list(range(100, 114))  # 14 tokens, positions 0..13
DEPTH = 10  # a branch's first token leaves the window of its last
SCRATCH = (30, 45)  # where each branch's run of slots starts (the row's sequence ends at 14)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    build_tokenizer(root / "tokenizer")
    return {name: FAMILIES[name][0](root / name, root / "tokenizer") for name in WINDOWED}


def _linear(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of `ids` fed in one forward from slot 0."""
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    model.setup_cache(1, 64, torch.float32, "cpu")
    return model(t, pos, pos, causal_mask(pos, 64))[0]


@pytest.mark.parametrize("family", WINDOWED)
@torch.inference_mode()
def test_tree_steps_keep_each_branchs_window(targets, family):
    model = load_model(targets[family], "cpu", "float32").model
    assert model.args.window is not None and model.args.window < DEPTH
    branches = [list(range(200, 200 + DEPTH)), list(range(300, 300 + DEPTH))]
    want = [_linear(model, PROMPT + b)[len(PROMPT) :] for b in branches]  # [DEPTH, V] each

    _linear(model, PROMPT)  # the row's sequence in slots 0..13
    mask = causal_mask(torch.tensor([[len(PROMPT) - 1] * 2]), 64).clone()  # [1, 2, 64]: the prompt
    got = []
    for d in range(DEPTH):  # one tree step per depth: both branches' next token
        slots = torch.tensor([[SCRATCH[0] + d, SCRATCH[1] + d]])  # [1, 2]
        mask[0, 0, SCRATCH[0] + d] = mask[0, 1, SCRATCH[1] + d] = True  # each sees its own ancestors
        ids = torch.tensor([[branches[0][d], branches[1][d]]])
        got.append(model(ids, torch.full((1, 2), len(PROMPT) + d), slots, mask)[0])  # [2, V]
    for b in range(2):
        torch.testing.assert_close(torch.stack([g[b] for g in got]), want[b], rtol=1e-4, atol=1e-4)

    taken = torch.arange(SCRATCH[1], SCRATCH[1] + DEPTH)  # the second branch wins
    model.copy_slots(0, taken, torch.arange(len(PROMPT), len(PROMPT) + DEPTH))
    nxt = len(PROMPT) + DEPTH
    pos = torch.tensor([[nxt]])
    step = model(torch.tensor([[7]]), pos, pos, causal_mask(pos, 64))[0, 0]  # [V]
    torch.testing.assert_close(step, _linear(model, PROMPT + branches[1] + [7])[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", WINDOWED)
def test_ssd_with_the_target_as_its_draft_accepts_every_token(targets, family):
    target = str(targets[family])
    fixed = (1,) * (DEPTH + 1)  # fixed fan-outs: every tree is decoded to its full depth, past the window
    spec = SpecConfig(mode=Mode.SSD, k=DEPTH, draft=draft_of(target), fan_out=fixed, fan_out_miss=fixed)
    params = SamplingParams(temperature=0.0, max_new_tokens=4 * DEPTH, ignore_eos=True)
    config = EngineConfig(target=ModelSpec(target, dtype="float32"), spec=spec, pin_cpus=False)
    with Engine(config) as engine:
        done = [e for e in engine.generate([PROMPT, PROMPT[3:]], params) if isinstance(e, DoneEvent)][0]
    stats = done.stats
    assert stats["acceptance_rate"] == 1.0 and stats["cache_hit_rate"] > 0.5, stats
