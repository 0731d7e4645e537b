"""DFlash block drafters (transformers' muse_glimmer_assistant form, z-lab's layout): greedy
SD with a block drafter gives AR's tokens, eager and in traced graphs, for several rows,
K = block_size - 1 and fewer, and rows starting from a stored prefix; every round's drafts
and every round's accepted count equal transformers' DFlashTokenCandidateGenerator's
(assisted generation, speculation_type="dflash") from the same verified prefix, with full
and sliding-window layers, on Llama, Qwen3 (tied embeddings) and Gemma 3 (scaled
embeddings, soft-capped logits) targets; z-lab's layout of the same weights drafts the
same; sampling stays a draw from the target's exact joint; SSD, a K past the block and
drafters this version does not build are refused."""

from __future__ import annotations

import json

import pytest
from support.tiny_dflash import as_zlab, make_dflash, train_dflash, transformers_rounds

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import ModelLoadError, UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import HeadDraft
from ssdlocal.draft import block as block_module
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time there was a little model",
    "Speculative decoding lets a small draft model",
]
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    """Token lists of one length (5), so the drafter trains on them in one batch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir["llama"])
    return [tok(t).input_ids[:5] for t in TEXTS]


@pytest.fixture(scope="module")
def trained(tiny_dir, prompts, tmp_path_factory):
    """A block-4 drafter trained a little on the target's answers to `prompts`: rounds
    accept 0 to 3 drafts."""
    drafter = make_dflash(tmp_path_factory.mktemp("dflash"), tiny_dir["llama"], block_size=4, target_layer_ids=(0, 1))
    train_dflash(drafter, tiny_dir["llama"], prompts)
    return drafter


def _done(engine, spec, prompts, params=GREEDY):
    return [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]


def _recording(monkeypatch) -> list[dict[int, list[int]]]:
    """Per row: {tokens the row held when it was drafted for: its drafts}, from every propose."""
    rounds: list[dict[int, list[int]]] = []
    propose = block_module.BlockDrafter.propose

    def recorded(self, active):
        proposal = propose(self, active)
        rounds[:] = rounds or [{} for _ in self.rows]
        for b, (row, drafts) in enumerate(zip(self.rows, proposal.drafts.tolist())):
            if active[b]:
                rounds[b][row.length] = drafts
        return proposal

    monkeypatch.setattr(block_module.BlockDrafter, "propose", recorded)
    return rounds


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_greedy_sd_with_a_dflash_drafter_equals_ar(tiny_dir, trained, prompts, graphs):
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), graphs=graphs)
    with Engine(config) as engine:
        ar = _done(engine, SpecConfig(mode=Mode.AR), prompts)
        for k in (3, 2):  # the whole block's drafts, and fewer
            sd = _done(engine, SpecConfig(mode=Mode.SD, k=k, draft=HeadDraft(str(trained), "dflash")), prompts)
            assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
            assert 0 < sd.stats.acceptance_rate < 1
        # the prompts again: the prefix store holds them, so the drafter's context starts later
        longer = [p + list(o.token_ids[:3]) for p, o in zip(prompts, ar.outputs)]
        again = _done(engine, SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(trained), "dflash")), longer)
        want = _done(engine, SpecConfig(mode=Mode.AR), longer)
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in want.outputs]
        if graphs == "trace":
            assert sd.stats.graphs["target"]["replays"] > 0


@pytest.mark.parametrize("case", ["llama, trained", "qwen3, sliding window", "gemma3", "gemma3, z-lab layout"])
def test_drafts_and_acceptance_equal_transformers_dflash(tiny_dir, trained, prompts, case, tmp_path, monkeypatch):
    """All prompts in one batch here, one by one in transformers: every round transformers
    ran (keyed by the tokens held before it) drafted the same tokens here, so each round
    accepted the same number, and the answers are the same, and AR's. z-lab's layout on Gemma 3 is
    held to transformers' rounds with the block's embeddings read as raw rows, as z-lab's
    dflash_generate reads them (a different drafter from the scaled one: its own case)."""
    if case == "llama, trained":
        target, drafter = tiny_dir["llama"], trained
    elif case == "qwen3, sliding window":  # every layer slides with a window of 6 (|q - k| <= 6)
        target = tiny_dir["qwen3"]
        drafter = make_dflash(tmp_path / "sliding", target, block_size=5, target_layer_ids=(0,), sliding_window=6)
    else:  # scaled embeddings (the block's are too), soft-capped logits (the drafts' are not), layer 3 is the last
        from support.tiny_families import make_gemma3

        target = make_gemma3(tmp_path / "gemma3", tiny_dir["llama"])
        drafter = make_dflash(tmp_path / "dflash", target, block_size=4, target_layer_ids=(1, 3))
    ran = as_zlab(drafter, tmp_path / "zlab") if case.endswith("z-lab layout") else drafter
    k = json.loads((drafter / "config.json").read_text())["block_size"] - 1
    ours = _recording(monkeypatch)
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"), prefix_cache_tokens=0)) as engine:
        done = _done(engine, SpecConfig(mode=Mode.SD, k=k, draft=HeadDraft(str(ran), "dflash")), prompts)
        ar = _done(engine, SpecConfig(mode=Mode.AR), prompts)
    assert [o.token_ids for o in done.outputs] == [o.token_ids for o in ar.outputs]  # greedy SD == AR
    accepted = []
    for b, prompt in enumerate(prompts):
        tokens, rounds = transformers_rounds(target, drafter, prompt, NEW, raw_rows=ran is not drafter)
        assert list(done.outputs[b].token_ids) == tokens
        assert len(rounds) > 3
        for held, candidates in rounds.items():
            assert ours[b][held] == candidates, (b, held)
        held = sorted(rounds)
        accepted += [after - before - 1 for before, after in zip(held, held[1:])]  # the same rounds here
    if case == "llama, trained":
        assert 0 in accepted and k in accepted  # rounds that took none and all of the block


def test_zlab_layout_drafts_the_same(tiny_dir, trained, prompts, tmp_path, monkeypatch):
    """z-lab's DFlashDraftModel layout of the same weights (fc, hidden_norm, dflash_config)."""
    zlab = as_zlab(trained, tmp_path / "zlab")
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"), prefix_cache_tokens=0)
    drafts = []
    with Engine(config) as engine:
        for path in (trained, zlab):
            drafts.append(_recording(monkeypatch))
            done = _done(engine, SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(path), "dflash")), prompts)
            monkeypatch.undo()
            assert done.stats.acceptance_rate > 0
    assert drafts[0] == drafts[1] and drafts[0]


def test_sampling_with_a_dflash_drafter_draws_from_the_targets_exact_joint(tiny_dir, tmp_path_factory):
    """At temperature 1 the drafter draws each position from its own q_j (draft/block.py
    says why that verifies losslessly) and the target accepts or resamples from the
    residual: the first three tokens follow the target's exact joint (chi-square,
    support/stats.py), with both accepted and rejected drafts in the run."""
    from dataclasses import replace

    from support.exact import K, N, PROMPT, T1, ExactJoint, sample_outputs
    from support.stats import assert_distribution
    from support.tiny_models import make_low_entropy_pair

    root = tmp_path_factory.mktemp("dflash-joint")
    target, _ = make_low_entropy_pair(tiny_dir["llama"], root)
    drafter = make_dflash(root / "dflash", target, block_size=K + 1, target_layer_ids=(0,))
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"))) as engine:
        params = replace(T1, seed=71)
        joint = ExactJoint(target, engine.encode(PROMPT, chat=False), params, N)
        done, rounds = sample_outputs(
            engine, SpecConfig(mode=Mode.SD, k=K, draft=HeadDraft(str(drafter), "dflash")), params
        )
    accepted = [a for r in rounds for a in r.n_accepted]
    assert 0 in accepted and any(a > 0 for a in accepted)  # both outcomes ran
    assert_distribution(joint.categories(done.outputs), joint.probs, what="SD with a DFlash drafter")


def test_ssd_a_k_past_the_block_and_unbuilt_drafters_are_refused(tiny_dir, trained, prompts, tmp_path):
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"))
    dflash2 = as_zlab(trained, tmp_path / "dflash2")
    raw = json.loads((dflash2 / "config.json").read_text())
    raw["architectures"], raw["dflash_config"]["selector_rank"] = ["DFlash2DraftModel"], 16
    (dflash2 / "config.json").write_text(json.dumps(raw))
    with Engine(config) as engine:
        with pytest.raises(UsageError, match="drafts in SD only"):
            _done(engine, SpecConfig(mode=Mode.SSD, k=3, draft=HeadDraft(str(trained), "dflash")), prompts[:1])
        with pytest.raises(UsageError, match="at most 3 tokens a round"):
            _done(engine, SpecConfig(mode=Mode.SD, k=4, draft=HeadDraft(str(trained), "dflash")), prompts[:1])
        with pytest.raises(ModelLoadError, match="does not build"):
            _done(engine, SpecConfig(mode=Mode.SD, k=3, draft=HeadDraft(str(dflash2), "dflash")), prompts[:1])


def test_the_cli_drafts_a_whole_block_when_k_is_not_given(tiny_dir, trained, monkeypatch, capsys):
    from support.cli import run_cli

    base = ("--target", str(tiny_dir["llama"]), "--draft", str(trained), "--dtype", "float32")
    code, out, err = run_cli(
        monkeypatch, capsys, "generate", "The quick brown fox", *base, "--max-new-tokens", "8", "--json"
    )
    assert code == 0, err
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    assert stats["mode"] == "sd" and "draft head" in err  # auto: SD, like every head
    assert len(stats["per_position_acceptance"]) == 3  # K = block_size - 1 (the drafter's block is 4)
    assert 1 <= stats["mean_accepted_len"] <= 4 and stats["acceptance_rate"] is not None  # tokens per round
    code, out, err = run_cli(monkeypatch, capsys, "generate", "The quick brown fox", *base, "--k", "2", "--json")
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["stats"]["per_position_acceptance"]) == 2
