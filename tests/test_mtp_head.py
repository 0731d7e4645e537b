"""The MTP layer a Qwen3.5 checkpoint ships (`mtp.*`), as a draft head
(backends/torch/heads/mtp.py, `--draft mtp`): its logits and states equal the published
formula computed with transformers' own Qwen3.5 modules (tests/support/tiny_mtp.py), for the
pairs it caught up on and for a step fed its own state, dense and MoE; greedy SD with it
gives AR's tokens, eager and in traced graphs; a layer built to compute the target's own
next-token function drafts only tokens the target accepts (acceptance exactly 1); sampling
stays a draw from the target's distribution (chi-square); `--draft mtp` names it on the
command line and a target without MTP weights is refused with a hint."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from support.tiny_families import make_qwen3_5, make_qwen3_5_moe
from support.tiny_models import build_tokenizer
from support.tiny_mtp import ReferenceMtp, add_mtp, make_copying_pair

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.events import DoneEvent, RoundEvent
from ssdlocal.core.models import HeadDraft
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Qwen3.5 dense and MoE targets with random MTP layers, the dense one without
    (`plain`), and the copying pair (`copy`)."""
    root = tmp_path_factory.mktemp("mtp")
    build_tokenizer(root / "tok")
    plain = make_qwen3_5(root / "plain", root / "tok")
    dense = shutil.copytree(plain, root / "dense")
    add_mtp(dense)
    moe = make_qwen3_5_moe(root / "moe", root / "tok")
    add_mtp(moe, seed=51)
    return {"plain": plain, "dense": dense, "moe": moe, "copy": make_copying_pair(plain, root / "copy")}


def _mtp(path, k: int = 3) -> SpecConfig:
    return SpecConfig(mode=Mode.SD, k=k, draft=HeadDraft(str(path), "mtp"))


def _run(engine, spec, prompts=PROMPTS, params=GREEDY):
    events = list(engine.generate(prompts, params, spec=spec))
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    return done, [e for e in events if isinstance(e, RoundEvent)]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_the_head_computes_the_published_formula(dirs, which):
    """After a catch-up over every pair of a 30-token sequence (the target's final states
    with the next tokens), the logits at its last pair, and then two steps each fed the
    head's own normed output with the drafted token, equal the reference forward over the
    same pairs; so do the states."""
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.heads import load_head

    ref = ReferenceMtp(dirs[which])
    vocab = ref.target.config.vocab_size
    ids = torch.randint(1, vocab, (1, 30), generator=torch.Generator().manual_seed(0))
    runner = registry.backend_for("torch").make_runner(
        registry.load(ModelSpec(str(dirs[which]), dtype="float32")), tree=False, graphs="off"
    )
    runner.reset(1, 64)
    runner.keep_hidden((-1,))
    runner.feed([ids[0].tolist()])
    hidden = runner.hidden()  # [1, 30, H]
    states = ref.final_states(ids)  # [1, 30, H]
    torch.testing.assert_close(hidden, states, rtol=1e-5, atol=1e-5)
    head = load_head("mtp", str(dirs[which]), runner.head_inputs(), vocab, runner.device)
    head.reset(1, 64)
    n = 29  # pairs (state after token q, token q + 1), q = 0..28
    ours = head.catch_up(ids[:, 1:], hidden[:, :n], torch.tensor([n]), torch.tensor([0]), n + 1)  # [1, V]
    tokens, pairs, positions = ids[:, 1:], states[:, :n], torch.arange(n)[None]
    for step in range(3):
        want, out = ref(tokens, pairs, positions)  # [1, T, V], [1, T, H]
        torch.testing.assert_close(ours, want[:, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(head.state, out[:, -1], rtol=1e-4, atol=1e-4)
        draft = ours.argmax(-1, keepdim=True)  # [1, 1]
        tokens, pairs = torch.cat([tokens, draft], 1), torch.cat([pairs, out[:, -1:]], 1)
        positions = torch.arange(n + step + 1)[None]
        ours = head.step(draft)[:, 0]
        head.advance(1)


@pytest.mark.parametrize(("which", "graphs"), [("dense", "off"), ("dense", "trace"), ("moe", "off")])
def test_greedy_sd_with_the_mtp_head_equals_ar(dirs, which, graphs):
    config = EngineConfig(target=ModelSpec(str(dirs[which]), dtype="float32"), graphs=graphs)
    with Engine(config) as engine:
        ar, _ = _run(engine, SpecConfig(mode=Mode.AR))
        sd, rounds = _run(engine, _mtp(dirs[which]))
        assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
        assert rounds and sd.stats.acceptance_rate is not None and sd.stats.mean_accepted_len is not None
        longer = [PROMPTS[0], PROMPTS[0] + " and more"]  # a stored prefix: the prefill feeds a part
        again, _ = _run(engine, _mtp(dirs[which], k=4), longer)
        want, _ = _run(engine, SpecConfig(mode=Mode.AR), longer)
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in want.outputs]
        if graphs == "trace":
            assert sd.stats.graphs["target"]["replays"] > 0


def test_a_layer_that_computes_the_targets_choice_is_always_accepted(dirs):
    """The copying pair: the target is a bigram model and its MTP layer computes the same
    function of the token it is handed (tiny_mtp.make_copying_pair), so every draft, the
    first from the target's verified tokens and the later ones from the head's own drafts,
    is the target's greedy choice: acceptance exactly 1, every round but the last full."""
    with Engine(EngineConfig(target=ModelSpec(str(dirs["copy"]), dtype="float32"))) as engine:
        ar, _ = _run(engine, SpecConfig(mode=Mode.AR))
        sd, rounds = _run(engine, _mtp(dirs["copy"], k=4))
    assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
    assert sd.stats.acceptance_rate == 1.0
    full = [n for r in rounds[:-1] for n in r.n_accepted]
    assert full and set(full) == {4}  # four drafts, four accepted, in every row of every round but the last


def test_sampling_with_the_mtp_head_draws_from_the_targets_exact_joint(dirs, tmp_path):
    """At temperature 1, SD with the head (a copying layer with noise in its `fc`, on a
    sharpened target) follows the target's exact joint of the first three tokens
    (chi-square), with both accepted and rejected drafts in the run."""
    from safetensors.torch import load_file, save_file
    from support.exact import K, N, PROMPT, T1, ExactJoint, sample_outputs
    from support.stats import assert_distribution
    from support.tiny_models import scale_lm_head

    target = shutil.copytree(dirs["copy"], tmp_path / "target")
    scale_lm_head(target, 3.0)
    (file,) = target.glob("*.safetensors")
    state = load_file(file)
    gen = torch.Generator().manual_seed(3)
    state["mtp.fc.weight"] = state["mtp.fc.weight"] + 0.4 * torch.randn(state["mtp.fc.weight"].shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})
    with Engine(EngineConfig(target=ModelSpec(str(target), dtype="float32"))) as engine:
        params = replace(T1, seed=71)
        joint = ExactJoint(target, engine.encode(PROMPT, chat=False), params, N)
        done, rounds = sample_outputs(engine, _mtp(target, k=K), params)
    accepted = [a for r in rounds for a in r.n_accepted]
    assert 0 in accepted and any(a > 0 for a in accepted)  # both outcomes ran
    assert_distribution(joint.categories(done.outputs), joint.probs, what="SD with an MTP head")


def test_a_target_without_mtp_weights_is_refused_with_a_hint(dirs, tiny_dir, monkeypatch, capsys):
    from support.cli import assert_clean_error, run_cli

    for target in (dirs["plain"], tiny_dir["llama"]):
        code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--target", str(target), "--draft", "mtp")
        assert_clean_error(code, err, 2, "--draft mtp needs a target checkpoint with multi-token-prediction", "hint:")
    config = EngineConfig(target=ModelSpec(str(dirs["plain"]), dtype="float32"))
    with Engine(config) as engine, pytest.raises(ModelLoadError, match="no multi-token-prediction weights"):
        _run(engine, _mtp(dirs["plain"]))


def test_the_cli_drafts_with_the_targets_mtp_layer(dirs, monkeypatch, capsys):
    from support.cli import check_head_draft_cli

    check_head_draft_cli(monkeypatch, capsys, "--target", str(dirs["dense"]), "--draft", "mtp", "--dtype", "float32")


def test_a_checkpoint_with_two_mtp_layers_is_refused_by_name(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from ssdlocal.backends.torch.heads.mtp import load_mtp

    target = shutil.copytree(dirs["dense"], tmp_path / "two")
    (file,) = target.glob("*.safetensors")
    state = load_file(file)
    state["mtp.layers.1.input_layernorm.weight"] = torch.zeros(state["mtp.norm.weight"].shape)
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="has 2 MTP layers") as info:
        load_mtp(target, None, 0, "cpu", torch.float32)
    assert info.value.hint
