"""Gemma 4's MTP assistant as a draft head (backends/torch/heads/gemma4_assistant.py): its
logits and states equal transformers' Gemma4AssistantForCausalLM on the same inputs (the
target's final hidden state, its cache's keys up to the newest verified position, the
masked vocabulary or the whole one); greedy SD with it gives AR's tokens, eager and in
traced graphs; round by round it drafts and is accepted exactly as transformers' own
assisted generation once that reads only the verified keys (and gives the same tokens as
the stock one); sampling stays a draw from the target's distribution (chi-square); a target
it cannot read is refused with a hint; the CLI takes its directory as --draft."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.exact import N, PROMPT, T1, ExactJoint, sample_outputs
from support.stats import assert_distribution
from support.tiny_heads import make_gemma4_assistant, make_gemma4_predictable
from support.tiny_models import build_tokenizer

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.events import DoneEvent, RoundEvent
from ssdlocal.core.models import HeadDraft
from ssdlocal.engine import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    if n < 2:", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
KIND = "gemma4_assistant"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A Gemma 4 target whose greedy choice a fitted assistant often drafts ("target",
    "assistant"), and the family tests' Gemma 4 with random assistants, masked ("random")
    and over the whole vocabulary ("plain")."""
    from support.tiny_families import make_gemma4

    root = tmp_path_factory.mktemp("gemma4_assistant")
    build_tokenizer(root / "tokenizer")
    out = {"target": make_gemma4_predictable(root / "target", root / "tokenizer")}
    out["assistant"] = make_gemma4_assistant(root / "assistant", out["target"], steps=120)
    out["family"] = make_gemma4(root / "family", root / "tokenizer")
    out["random"] = make_gemma4_assistant(root / "random", out["family"])
    out["plain"] = make_gemma4_assistant(root / "plain", out["family"], ordered=False)
    return out


def _run(engine, spec, prompts=PROMPTS, params=GREEDY):
    events = list(engine.generate(prompts, params, spec=spec))
    return [e for e in events if isinstance(e, DoneEvent)][0], [e for e in events if isinstance(e, RoundEvent)]


def _sd(path, k=3):
    return SpecConfig(mode=Mode.SD, k=k, draft=HeadDraft(str(path), KIND))


@pytest.mark.parametrize("which", ["random", "plain"])
def test_the_assistant_computes_what_transformers_computes(dirs, which):
    """At positions inside and past the sliding window: our runner's catch-up and next step
    (logits and states) equal transformers' assistant handed the target's final hidden
    state and its shared keys/values up to the newest verified position."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from ssdlocal.backends.torch.heads import load_head
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.backends.torch.runner import TorchRunner

    target = Gemma4ForCausalLM.from_pretrained(dirs["family"], dtype=torch.float32).eval()
    reference = Gemma4AssistantForCausalLM.from_pretrained(dirs[which], dtype=torch.float32).eval()
    ids = torch.randint(1, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    runner = TorchRunner(load_model(str(dirs["family"]), dtype="float32"), graphs="off")
    runner.reset(1, 64)
    runner.keep_hidden((-1,))
    runner.feed([ids[0].tolist()])
    hidden = runner.hidden()  # [1, 30, D]
    head = load_head(KIND, str(dirs[which]), runner.head_inputs(), target.config.vocab_size, runner.device)
    head.reset(1, 64)
    embed = target.get_input_embeddings()
    for q in (3, 12, 25):  # the sliding window is 8: 12 and 25 see only its last 9 keys
        shared = {k: (v[0][:, :, : q + 1], v[1][:, :, : q + 1]) for k, v in out.shared_kv_states.items()}
        token = ids[:, q + 1 : q + 2]  # [1, 1]
        ours = head.catch_up(token, hidden[:, q : q + 1], torch.tensor([1]), torch.tensor([q]), q + 2)  # [1, V]
        state = out.hidden_states[-1][:, q : q + 1]
        for step in range(3):
            with torch.no_grad():
                want = reference(
                    inputs_embeds=torch.cat([embed(token), state], dim=-1),
                    position_ids=torch.tensor([[q + 1]]),
                    shared_kv_states=shared,
                )
            torch.testing.assert_close(ours, want.logits[:, 0].float(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(head.state, want.last_hidden_state[:, 0], rtol=1e-5, atol=1e-5)
            token, state = ours.argmax(-1, keepdim=True), want.last_hidden_state
            ours = head.step(token)[:, 0]  # the next draft: same position, its own state


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_greedy_sd_with_the_assistant_equals_ar(dirs, graphs):
    config = EngineConfig(target=ModelSpec(str(dirs["target"]), dtype="float32"), graphs=graphs)
    with Engine(config) as engine:
        ar, _ = _run(engine, SpecConfig(mode=Mode.AR))
        sd, rounds = _run(engine, _sd(dirs["assistant"]))
        assert [o.token_ids for o in sd.outputs] == [o.token_ids for o in ar.outputs]
        accepted = {n for r in rounds for n in r.n_accepted}
        assert {0, 3} <= accepted and len(accepted) > 2  # rejections, full acceptances and between
        assert 0.2 < sd.stats.acceptance_rate < 0.95 and sd.stats.mean_accepted_len > 1.5
        longer = [PROMPTS[0], PROMPTS[0] + " and more"]  # a stored prefix: the prefill feeds a part
        again, _ = _run(engine, _sd(dirs["assistant"], k=4), longer)
        want, _ = _run(engine, SpecConfig(mode=Mode.AR), longer)
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in want.outputs]
        if graphs == "trace":
            assert sd.stats.graphs["target"]["replays"] > 0


def test_rounds_equal_transformers_assisted_generation(dirs, monkeypatch):
    """Per prompt, batch 1, K = 3: the tokens equal transformers' assisted generation (stock
    and with the verified keys only); every round drafts the same tokens and accepts as
    many as transformers' reading only the verified keys (its last round, which transformers
    shortens to the length left, aside)."""
    from support.hf_assisted import hf_assisted
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from ssdlocal.draft import head as head_module

    target = Gemma4ForCausalLM.from_pretrained(dirs["target"], dtype=torch.float32).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(dirs["assistant"], dtype=torch.float32).eval()
    drafted: list[list[int]] = []
    propose = head_module.HeadDrafter.propose

    def recorded(self, active):  # the drafts as the drafter hands them to the target
        proposal = propose(self, active)
        drafted.append(proposal.drafts[0].tolist())
        return proposal

    monkeypatch.setattr(head_module.HeadDrafter, "propose", recorded)
    config = EngineConfig(target=ModelSpec(str(dirs["target"]), dtype="float32"))
    with Engine(config) as engine:
        for prompt in PROMPTS[:2]:
            drafted.clear()
            done, rounds = _run(engine, _sd(dirs["assistant"]), [prompt])
            ours = list(done.outputs[0].token_ids)
            ids = list(engine.encode(prompt, chat=False))
            stock = hf_assisted(target, assistant, ids, 3, GREEDY.max_new_tokens)
            fixed = hf_assisted(target, assistant, ids, 3, GREEDY.max_new_tokens, fixed=True)
            assert ours == stock.tokens == fixed.tokens
            whole = len(fixed.accepted) - 1
            assert [r.n_accepted[0] for r in rounds][:whole] == fixed.accepted[:whole]
            assert drafted[:whole] == fixed.drafts[:whole]


def test_sampling_with_the_assistant_is_lossless(dirs):
    """T = 1: the first three tokens of N samples follow the target's exact joint (drafts
    drawn from the assistant's masked distribution, verified with it)."""
    config = EngineConfig(target=ModelSpec(str(dirs["target"]), dtype="float32"), pin_cpus=False)
    with Engine(config) as engine:
        params = replace(T1, seed=45)
        joint = ExactJoint(dirs["target"], engine.encode(PROMPT, chat=False), params, N)
        done, _ = sample_outputs(engine, _sd(dirs["assistant"], k=2), params)
    assert 0.1 < done.stats["acceptance_rate"] < 0.9  # accepted often, rejected more often
    assert_distribution(joint.categories(done.outputs), joint.probs, what="SD with a Gemma 4 assistant")


def test_an_assistant_is_refused_for_a_target_it_cannot_read(dirs, tiny_dir):
    """A target of another width, or without the assistant's layer types, with a hint; the
    family tests' Gemma 4 (its widths and types) is read."""
    cases = {
        "small_llama": "assistant for a 64-wide target with 384 tokens; the target is 32 wide",
        "llama": "attends over sliding_attention layers, which the target does not have",
    }
    for name, message in cases.items():
        with Engine(EngineConfig(target=ModelSpec(str(tiny_dir[name]), dtype="float32"))) as engine:
            with pytest.raises(ModelLoadError, match=message) as info:
                _run(engine, _sd(dirs["random"]), PROMPTS[:1])
            assert "assistant published for this target" in info.value.hint
    with Engine(EngineConfig(target=ModelSpec(str(dirs["family"]), dtype="float32"))) as engine:
        done, _ = _run(engine, _sd(dirs["random"]), PROMPTS[:1])
        assert done.outputs[0].finish_reason == "length"


def test_the_cli_takes_an_assistant_as_draft(dirs, monkeypatch, capsys):
    from support.cli import check_head_draft_cli

    check_head_draft_cli(
        monkeypatch, capsys, "--target", dirs["target"], "--draft", dirs["assistant"], "--dtype", "float32"
    )
