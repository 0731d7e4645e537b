"""Draft heads that read the target's hidden states (EAGLE-3, published format): greedy SD
with a head gives AR's tokens, eager and in traced graphs, with several rows and carried
rows; the head's cache holds what a from-scratch forward of the same pairs computes (its
bookkeeping of positions across rounds); sampling stays a draw from the target's
distribution (verification uses the head's q); a backend that cannot give hidden states,
or SSD, is refused with a hint."""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_heads import make_eagle3

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import HeadDraft
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def head_dir(tiny_dir, tmp_path_factory):
    return make_eagle3(tmp_path_factory.mktemp("eagle3"), tiny_dir["llama"])


def _done(engine, spec, prompts=PROMPTS, params=GREEDY):
    return [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_greedy_sd_with_an_eagle3_head_equals_ar(tiny_dir, head_dir, graphs):
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), graphs=graphs)
    head = SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(head_dir)))
    with Engine(config) as engine:
        ar = _done(engine, SpecConfig(mode=Mode.AR))
        sd = _done(engine, head)
        assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
        assert sd.stats.rounds > 0 and sd.stats.acceptance_rate is not None
        again = _done(engine, head, [PROMPTS[0], PROMPTS[0] + " and more"])  # a stored prefix: start > 0
        want = _done(engine, SpecConfig(mode=Mode.AR), [PROMPTS[0], PROMPTS[0] + " and more"])
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in want.outputs]
        if graphs == "trace":
            assert sd.stats.graphs["target"]["replays"] > 0


def test_the_heads_cache_equals_a_forward_over_every_pair(tiny_dir, head_dir, monkeypatch):
    """After the prompt and several rounds, the head's logits for the next draft equal one
    forward of the head over every (state, next token) pair from position 0, computed from
    the target's own hidden states: its positions, cache and catch-ups agree."""
    from ssdlocal.backends.torch.attention import AttentionMask
    from ssdlocal.backends.torch.models import causal_mask
    from ssdlocal.draft import head as head_module

    from ssdlocal.draft import factory

    made = []
    monkeypatch.setitem(factory.BUILDERS, HeadDraft, lambda *a: made.append(head_module.build_head(*a)) or made[-1])
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), prefix_cache_tokens=0)
    with Engine(config) as engine:
        done = _done(engine, SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(head_dir))), PROMPTS[:1])
        drafter = made[-1]
        tokens = list(engine.encode(PROMPTS[0], chat=False)) + list(done.outputs[0].token_ids)
        model, head = engine.runner.model, drafter.runner.head
        n = len(tokens) - 1
        ids = torch.tensor([tokens[:n]])
        pos = torch.arange(n)[None]
        engine.runner.reset(1, 128)
        with torch.inference_mode():
            _, states = model(ids, pos, pos, None, None, drafter.hidden, True)  # [1, n, 3H]
            drafter.runner.reset(1, 128)
            mask = AttentionMask.build(causal_mask(pos, n), 2, torch.float32)
            want, _ = head(torch.tensor([tokens[1 : n + 1]]), states, pos, mask, fuse=True)
    assert done.outputs[0].finish_reason == "length"
    # the drafter's last catch-up covered the row up to its newest token: its next draft's logits
    torch.testing.assert_close(drafter.first[0], want[0, -1], rtol=1e-4, atol=1e-4)


def test_a_head_is_refused_for_ssd_and_for_backends_without_hidden_states(tiny_dir, head_dir):
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"))
    with Engine(config) as engine:
        with pytest.raises(UsageError, match="drafts in SD only"):
            _done(engine, SpecConfig(mode=Mode.SSD, k=3, draft=HeadDraft(str(head_dir))))
    tp = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), target_devices=("cpu", "cpu"))
    with Engine(tp) as engine:
        with pytest.raises(UsageError, match="needs a target on one device"):
            _done(engine, SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(head_dir))))


def test_the_cli_takes_a_head_as_draft_and_check_compares_sd_only(tiny_dir, head_dir, monkeypatch, capsys):
    from support.cli import check_head_draft_cli

    base = ("--target", str(tiny_dir["llama"]), "--draft", str(head_dir), "--dtype", "float32")
    out = check_head_draft_cli(monkeypatch, capsys, *base)
    assert "greedy AR / SD on 3 prompts" in out and "ssd" not in out.lower().split()


def test_sampling_with_a_head_draws_from_the_targets_exact_joint(tiny_dir, tmp_path_factory):
    """At temperature 1, SD with a head proposes from the head's q over its reduced
    vocabulary (zero elsewhere) and the target accepts or resamples from the residual:
    the first three tokens follow the target's exact joint (chi-square, support/stats.py),
    with both accepted and rejected drafts in the run."""
    from dataclasses import replace

    from support.exact import K, N, PROMPT, T1, ExactJoint, sample_outputs
    from support.stats import assert_distribution
    from support.tiny_models import make_low_entropy_pair

    root = tmp_path_factory.mktemp("head-joint")
    target, _ = make_low_entropy_pair(tiny_dir["llama"], root)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    head = make_eagle3(root / "head", target, draft_vocab=vocab // 2)
    config = EngineConfig(target=ModelSpec(str(target), dtype="float32"))
    with Engine(config) as engine:
        params = replace(T1, seed=70)
        joint = ExactJoint(target, engine.encode(PROMPT, chat=False), params, N)
        done, rounds = sample_outputs(engine, SpecConfig(mode=Mode.SD, k=K, draft=HeadDraft(str(head))), params)
    accepted = [a for r in rounds for a in r.n_accepted]
    assert 0 in accepted and any(a > 0 for a in accepted)  # both outcomes ran
    assert_distribution(joint.categories(done.outputs), joint.probs, what="SD with an EAGLE-3 head")
