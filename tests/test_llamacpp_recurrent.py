"""Hybrid (recurrent) models on the llama.cpp runner, without the compiled library:
backends/llamacpp/recurrent.py against `FakeRecurrentLib` (support/fake_llamalib.py), whose
decode fails when a sequence's recurrent state is not exactly the tokens its cells hold.
Rows cut back after rejected drafts (llama.cpp's snapshots, a checkpoint, from nothing),
a draft's one-token steps cut back several, SSD tree branches that start inside a row,
the prefix store (whole entries only) and the engine's AR == SD, bit for bit against the
fake's reference. The real library's run of the same paths is test_llamacpp_families.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.fake_llamalib import FakeRecurrentLib, model_logits, reference_greedy

from ssdlocal.backends.base import Logits
from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
from ssdlocal.backends.llamacpp import loader as gguf_loader
from ssdlocal.backends.llamacpp import runner as runner_module
from ssdlocal.backends.llamacpp.prefix import StateStore
from ssdlocal.backends.llamacpp.recurrent import RecurrentRows
from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

K = 3
N = 20
PROMPT = [5, 17, 3, 99, 42, 8, 61]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir["llama"])


@pytest.fixture
def fake(monkeypatch, tokenizer, tiny_dir, tmp_path):
    vocab = json.loads((tiny_dir["llama"] / "config.json").read_text())["vocab_size"]
    lib = FakeRecurrentLib(vocab, tokenizer)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.lib.LlamaLib", lambda verbose=False: lib)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.probe.installed", lambda: False)
    monkeypatch.setattr(gguf_loader, "gguf_tokenizer", lambda path: tokenizer)
    monkeypatch.setattr("ssdlocal.backends.llamacpp.gguf_tokenizer", lambda path: tokenizer)
    paths = []
    for name in ("target.gguf", "draft.gguf"):
        (tmp_path / name).write_bytes(b"GGUF" + b"\0" * 60)
        paths.append(str(tmp_path / name))
    return lib, paths[0], paths[1]


def reference(lib, n: int = N) -> tuple[list[int], np.ndarray]:
    """The fake target's greedy answer to PROMPT and the logits of each of its tokens."""
    answer = reference_greedy("target.gguf", PROMPT, n, lib.vocab)
    seq = PROMPT + answer
    return answer, np.stack([model_logits("target.gguf", seq[: len(PROMPT) + i], lib.vocab) for i in range(n)])


def verify_rounds(runner, answer: list[int], wrong_at: list[int]) -> np.ndarray:
    """SD's target: per round the pending token and K drafts of the answer, the draft at
    wrong_at[r] wrong (K: none), the row cut back to what was accepted (step / advance);
    the logits of the positions whose inputs were right, in answer order."""
    runner.reset(1, len(PROMPT) + N + K + 2)
    runner.feed([PROMPT[:-1]], Logits.NONE)
    runner.begin_steps()
    seq, at, kept = PROMPT + answer, len(PROMPT) - 1, []
    for wrong in wrong_at:
        drafts = list(seq[at + 1 : at + 1 + K])
        if wrong < K:
            drafts[wrong] = (drafts[wrong] + 1) % runner.vocab_size
        logits = runner.step(torch.tensor([[seq[at], *drafts]]))[0].numpy()  # [K+1, V]
        kept.extend(logits[: wrong + 1])
        runner.advance(wrong + 1)
        at += wrong + 1
    runner.end_steps({})
    return np.stack(kept)


ROUNDS = [0, 2, 3, 1, 0, 3]  # rejected first, second... none


@pytest.mark.parametrize("way", ["snapshot", "checkpoint", "scratch"])
def test_a_target_cut_after_rejections_scores_as_the_reference(fake, monkeypatch, way):
    """Each way of cutting a recurrent row back gives the reference's logits bit for bit;
    with llama.cpp's snapshots nothing is decoded again."""
    lib, target, _ = fake
    if way != "snapshot":
        monkeypatch.setattr(runner_module, "SNAPSHOTS", 0)
    if way == "scratch":
        monkeypatch.setattr(RecurrentRows, "_before_decode", lambda self, row, n_new, cut: None)
    answer, logits = reference(lib)
    runner = LlamaCppRunner(load_gguf(target))
    ours = verify_rounds(runner, answer, ROUNDS)
    assert np.array_equal(ours, logits[: len(ours)])
    assert runner.rollbacks[way] == sum(w < K for w in ROUNDS)  # one cut per round with a rejection
    assert (runner.rollbacks["again"] == 0) is (way == "snapshot")


def test_a_cut_past_the_last_decode_call_does_not_use_the_snapshots(fake):
    """A draft's one-token steps cut back several tokens: llama.cpp's snapshots cover only
    the last call (they would give a stale state), so the row's checkpoint from the start
    of its steps is set back and the kept tokens decoded again."""
    lib, target, _ = fake
    answer, logits = reference(lib)
    runner = LlamaCppRunner(load_gguf(target))
    runner.reset(1, 64)
    runner.feed([PROMPT], Logits.NONE)
    runner.begin_steps()
    for t in answer[:4]:  # four steps of one token
        runner.step(torch.tensor([[t]]))
        runner.advance(1)
    runner.advance(-3)  # one kept
    nxt = runner.step(torch.tensor([[answer[1]]]))[0, 0].numpy()
    assert np.array_equal(nxt, logits[2])
    assert runner.rollbacks["checkpoint"] == 1 and runner.rollbacks["snapshot"] == 0


def test_tree_branches_start_inside_a_recurrent_row(fake):
    """SSD's draft: branches at every accepted length of the row's proposal get the row's
    state there (its checkpoint and the tokens after it), and an adopted branch replaces
    the row's sequence."""
    lib, target, _ = fake
    answer, logits = reference(lib)
    runner = LlamaCppRunner(load_gguf(target), tree=True)
    slots = len(PROMPT) + N + 2 * K + 8
    runner.reset(1, slots)
    runner.feed([PROMPT], Logits.NONE)
    runner.feed([answer[:K]], Logits.NONE)
    scratch = len(PROMPT) + K + 2
    starts = [len(PROMPT) + k for k in range(K + 1)]
    mask = torch.zeros(1, K + 1, slots, dtype=torch.bool)
    for i, n in enumerate(starts):
        mask[0, i, :n] = True
        mask[0, i, scratch + i] = True
    out = runner.forward_raw(
        torch.tensor([answer[: K + 1]]),
        torch.tensor([starts]),
        torch.tensor([[scratch + i for i in range(K + 1)]]),
        mask,
    )[0].numpy()
    assert np.array_equal(out, logits[1 : K + 2])
    runner.take_branch(0, [scratch + 1], len(PROMPT) + 1, [answer[1]])
    assert np.array_equal(runner.feed([[answer[2]]])[0][-1].numpy(), logits[3])


def test_engine_sd_equals_ar_and_stored_prefixes_are_used_whole(fake):
    """Through the engine: a recurrent target and draft give AR's tokens in SD; follow-ups
    batched together whose prompts extend a first call's tokens start from its stored row
    (a whole entry: the state is at its end; rows of a batch take all they share) and give
    the reference's tokens; a prompt that parts from an entry inside it takes nothing."""
    lib, target, draft = fake
    params = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    spec = SpecConfig(mode=Mode.SD, k=K, draft=ModelDraft(ModelSpec(draft, backend="llamacpp"), suffix=None))
    cfg = EngineConfig(target=ModelSpec(target, backend="llamacpp"), spec=spec, pin_cpus=False)
    with Engine(cfg) as eng:
        assert eng.runner.recurrent

        def run(prompts, sp):
            done = next(e for e in eng.generate(prompts, params, spec=sp) if isinstance(e, DoneEvent))
            return [list(o.token_ids) for o in done.outputs]

        prompts = [PROMPT, PROMPT[:4] + [7, 7]]
        ar = run(prompts, SpecConfig(mode=Mode.AR))
        assert ar[0] == reference_greedy("target.gguf", PROMPT, N, lib.vocab)
        assert run(prompts, spec) == ar
        follow_ups = [PROMPT + ar[0] + [11, 12], PROMPT + ar[0][:5] + [9]]
        reused = eng.runner.prefix_report()["reused_tokens"]
        out = run(follow_ups, spec)
        assert out == [reference_greedy("target.gguf", p, N, lib.vocab) for p in follow_ups]
        assert eng.runner.prefix_report()["reused_tokens"] - reused >= len(PROMPT) + N - 1
        assert eng.runner.prefix.best(follow_ups[1], count=False) == (None, 0)


def test_a_recurrent_model_passes_the_width_check_and_sd_equals_ar(fake):
    """--batch-invariant: the width check rewinds its scratch sequence through a saved
    state (a recurrent tail cannot be dropped), and SD stays AR."""
    _, target, draft = fake
    params = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    model = ModelDraft(ModelSpec(draft, backend="llamacpp"), suffix=None)
    cfg = EngineConfig(
        target=ModelSpec(target, backend="llamacpp", batch_invariant=True),
        spec=SpecConfig(mode=Mode.SD, k=K, draft=model),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        outs = [
            next(e for e in eng.generate([PROMPT], params, spec=sp) if isinstance(e, DoneEvent)).outputs[0].token_ids
            for sp in (SpecConfig(mode=Mode.AR), cfg.spec)
        ]
        assert eng.runner.alike_width >= 2
    assert list(outs[0]) == list(outs[1])


def test_a_whole_only_store_matches_entries_that_begin_the_tokens():
    """A recurrent model's saved state is at its entry's end: only an entry all of whose
    tokens begin a row's is a match, and a longer entry does not replace a shorter one."""
    store = StateStore(100, whole=True)
    store.put([1, 2, 3, 4], b"s4", 4, 0)
    entry, n = store.best([1, 2, 3, 4, 5])
    assert (entry.tokens, n) == ((1, 2, 3, 4), 4)
    assert store.best([1, 2, 3, 9]) == (None, 0)  # a part of an entry is no match
    assert store.wanted([1, 2], 0)  # a prefix of an entry is kept on its own
    store.put([1, 2], b"s2", 2, 0)
    store.put([1, 2, 3, 4, 5, 6], b"s6", 6, 0)
    assert sorted(e.tokens for e in store.entries.values()) == [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
    assert store.best([1, 2, 7])[0].state == b"s2"
    assert not store.wanted([1, 2, 3, 4], 0)  # the same tokens again add nothing
