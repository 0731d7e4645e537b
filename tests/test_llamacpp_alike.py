"""--batch-invariant on the llama.cpp backend, without the compiled library.

`ShapedLib` (support/llamacpp_fakes.py) is the fake LlamaLib of the runner tests with
llama.cpp's CPU kernel families in miniature: a token's logits shift by a vector that depends on how many tokens
its call holds (one; two or three; four and more), as the float32 query of a lone token
and the matrix-matrix kernel of repacked weights do. With it greedy SD leaves AR; with
`batch_invariant` every step goes in calls of two or three tokens and SD equals AR.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.fake_llamalib import model_logits
from support.llamacpp_fakes import GREEDY, PROMPTS, fake, run, shaped, tok_dir, tokenizer, vocab  # noqa: F401 - fixtures

from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
from ssdlocal.backends.llamacpp.alike import Call, balanced, plan_calls, widest_alike
from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, NgramDraft, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.engine import Engine


def _engine(target: str, draft: str, alike: bool) -> Engine:
    spec = ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))
    return Engine(
        EngineConfig(
            target=ModelSpec(target, backend="llamacpp", dtype="float32", batch_invariant=alike),
            spec=SpecConfig(mode=Mode.SD, k=3, draft=spec),
        )
    )


def test_kernel_families_part_sd_from_ar_without_it(shaped):
    _lib, target, draft = shaped
    with _engine(target, draft, alike=False) as eng:
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        sd, _ = run(eng, PROMPTS)
    assert sd != ar  # what the option is for: a 4-token verification is another kernel


def test_batch_invariant_steps_make_sd_equal_ar(shaped, tokenizer, vocab):
    lib, target, draft = shaped
    with _engine(target, draft, alike=True) as eng:
        assert eng.runner.alike and eng.prefix_tokens == 0  # every call from an empty cache
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        assert eng.runner.alike_width == 3  # checked on the first decode
        sd, stats = run(eng, PROMPTS)
        ngram, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=4, draft=NgramDraft()))
        one, _ = run(eng, PROMPTS[1:2])
        target_ctx = id(eng.runner._ctx)
        pad_seq = eng.runner._pad_seq
    assert sd == ar and ngram == ar and one == ar[1:2]
    assert stats["acceptance_rate"] > 0.3
    # every step of AR is a call of two (the pad beside it): the middle family throughout
    seq = list(tokenizer.encode(PROMPTS[0]))
    for _ in range(GREEDY.max_new_tokens):
        seq.append(int(np.argmax(model_logits("target.gguf", seq, vocab) + lib.shift[1])))
    assert ar[0] == seq[-GREEDY.max_new_tokens :]
    steps = [seqs for ctx, seqs in lib.widths if ctx == target_ctx and len(seqs) < 8]
    assert steps and all(2 <= len(seqs) <= 3 for seqs in steps)
    assert any(pad_seq in seqs for seqs in steps)


def test_plan_calls_splits_steps_and_pads_a_lone_token():
    # sequence 0 reads a prompt (wants only its last logits); 1 verifies 5; 2 steps 1
    seqs = [0] * 6 + [1] * 5 + [2]
    want = [False] * 5 + [True] + [True] * 6
    calls = plan_calls(seqs, want, width=3, n_batch=4)
    assert calls[:2] == [Call([0, 1, 2, 3]), Call([4])]  # the prompt: chunks of n_batch...
    steps = calls[2:]  # ...but its last token (its logits wanted) goes with the steps
    assert [len(c.index) for c in steps] == balanced(7, 3) == [3, 2, 2]
    assert [i for c in steps for i in c.index] == list(range(5, 12)) and not any(c.pad for c in steps)
    assert plan_calls([0, 0, 0], [False] * 3, width=3, n_batch=8) == [Call([0, 1, 2])]  # read ahead
    assert plan_calls([4], [True], width=3, n_batch=8) == [Call([0], pad=True)]
    assert balanced(7, 3) == [3, 2, 2] and balanced(7, 7) == [7]


def _fake_decode(family):
    """decode/remove over a 'model' whose logits are its token and position, shifted by
    family(call's tokens, seqs)."""
    cells: dict[int, set[int]] = {}

    def decode(tokens, positions, seqs, want):
        for p, s in zip(positions, seqs):
            cells.setdefault(s, set()).add(p)
        shift = family(tokens, seqs)
        return np.array([[t, p + shift] for t, p, w in zip(tokens, positions, want) if w], np.float32)

    def remove(seq, p0):
        cells[seq] = {p for p in cells.get(seq, set()) if p < p0}

    return decode, remove, cells


@pytest.mark.parametrize(
    ("family", "guess", "widest"),
    [
        (lambda t, s: 0.5 * (len(t) >= 4), 7, 3),  # repacked weights
        (lambda t, s: 0.5 * (len(t) >= 8), 7, 7),  # tiled K-quants
        (lambda t, s: 0.5 * (len(t) % 2), 7, 2),  # kernels that take two columns at a time
        (lambda t, s: 0.5 * (len(t) >= 4), 2, 2),  # never wider than the guess
        (lambda t, s: 0.5 * (len(t) == 1), 7, 7),  # a lone token differs: the pad hides it
        (lambda t, s: 0.5 * (9 in s), 7, 0),  # the pad itself changes a token: nothing holds
    ],
)
def test_widest_alike_finds_the_widest_equal_width(family, guess, widest):
    decode, remove, cells = _fake_decode(family)
    assert widest_alike(decode, remove, guess, seq=8, pad_seq=9, vocab=100) == widest
    assert not cells[8] and not cells[9]  # both sequences left empty


def test_a_machine_where_nothing_holds_is_a_usage_error(shaped):
    lib, target, _ = shaped
    lib.shift[1] = lib.shift[0] + 1.0  # calls of two differ from...
    runner = LlamaCppRunner(load_gguf(target))
    runner.alike = True
    runner.reset(1, 32)
    pad_seq = runner._pad_seq
    real = lib.decode

    def pad_sensitive(ctx, tokens, positions, seqs, want, n_vocab):
        out = real(ctx, tokens, positions, seqs, want, n_vocab)
        return out + (1.0 if pad_seq in seqs and len(out) else 0.0)  # ...and a pad moves a token

    lib.decode = pad_sensitive
    with pytest.raises(UsageError, match="--batch-invariant cannot hold") as exc:
        runner.feed([[1, 2, 3]])
    assert "drop --batch-invariant" in exc.value.hint


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("llamacpp", "cuda")])
def test_batch_invariant_is_for_llama_cpp_on_a_cpu(backend, device):
    with pytest.raises(UsageError, match="llama.cpp backend on a CPU"):
        ModelSpec("m.gguf", device, backend=backend, batch_invariant=True)


def test_which_requests_answer_the_same_every_run():
    """`same_every_run` (the server's stats and generate --json): only llama.cpp's CPU
    kernels part with it, for rows batched or overlapping, and drafting without
    --batch-invariant (docs/architecture.md §2)."""
    from ssdlocal.backends.llamacpp.alike import same_every_run
    from ssdlocal.core.models import BackendName

    cpu = (BackendName.LLAMACPP, "cpu")
    assert same_every_run(*cpu, False, drafted=False, alone=True)
    assert not same_every_run(*cpu, False, drafted=False, alone=False)
    assert not same_every_run(*cpu, False, drafted=True, alone=True)
    assert same_every_run(*cpu, True, drafted=True, alone=True)
    assert not same_every_run(*cpu, True, drafted=False, alone=False)
    assert same_every_run(BackendName.LLAMACPP, "cuda:0", False, drafted=True, alone=False)
    assert same_every_run(BackendName.TORCH, "cpu", False, drafted=True, alone=False)
