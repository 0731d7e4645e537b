"""Statistical losslessness end to end at temperature 1: AR, SD and SSD samples follow
the target's exact distribution over the first three generated tokens.

Reference: the exact joint p(t1, t2, t3 | prompt) = p(t1) p(t2 | t1) p(t3 | t1, t2),
computed from the target's logits with transformers (an independent implementation of
the same checkpoint), each conditional warped by `logits_to_probs` exactly as the
engine warps p (temperature, top-p). Every pair (t1, t2) with probability >= 1/N is
enumerated with all V choices of t3; all other triples form one "other" category whose
probability is exactly 1 minus the rest (a triple is never likelier than its pair, so
no category with >= 1 expected count hides in "other"). support/stats.py pools categories
below 5 expected counts, and ALPHA = 1e-4 (a correct implementation fails < 1 in 10^4).

Why three tokens: the first token comes from the prefill and the second from round 0,
which SSD always drafts just-in-time. The third comes from round 1 whenever round 0
rejected its first draft, and round 1 is served from the speculation cache (a hit) or
by the backup (jit / ngram / none). The tests assert both paths actually ran.

Models: a low-entropy target (the tiny llama with its lm_head scaled x3: top-1 ~0.55,
top-5 ~0.85 at T=1) and a draft that differs on purpose (a noisy copy whose lm_head is
flattened x0.8), so about half the first drafts are rejected and the residual path
carries a lot of mass; in round 1 about 60% of the rows hit the cache.

Power: N = 2500 samples per configuration (one batch of the prompt repeated; SSD's
worker takes a few seconds per configuration at this batch size on a 2-core CPU).
The broken variants below give p-values below 1e-35 (bonus drawn from p instead of
the residual; acceptance by "draft == argmax p"), and even AR samples at T=1 checked
against the joint at T=0.9 fail (p ~1e-33); as a rule of thumb a lossy variant that
moves ~5% of probability between likely outcomes is caught.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.stats import (
    assert_distribution,
    assert_not_distribution,
    chi_square_pvalue,
)

import ssdlocal.core.verify as verify_mod
from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.sampling import sample
from ssdlocal.core.verify import Verdict, verify
from ssdlocal.engine import Engine
from ssdlocal.core.config import ModelDraft
from support.exact import FAN, K, N, PROMPT, T1, ExactJoint, sample_outputs


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """(target, draft) directories: a low-entropy target and a deliberately different draft."""
    from support.tiny_models import make_low_entropy_pair

    return make_low_entropy_pair(tiny_dir["llama"], tmp_path_factory.mktemp("lowent"))


@pytest.fixture(scope="module")
def engine(models):
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread here and in the worker: no oversubscription
    target, draft = models
    cfg = EngineConfig(
        target=ModelSpec(str(target), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=K, draft=ModelDraft(ModelSpec(str(draft), dtype="float32"))),
        pin_cpus=False,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # read by the SSD worker when it starts
        with Engine(cfg) as eng:
            yield eng
    torch.set_num_threads(old)


_JOINTS: dict = {}


def exact_joint(engine: Engine, models, params: SamplingParams) -> ExactJoint:
    key = (params.temperature, params.top_k, params.top_p)
    if key not in _JOINTS:
        prompt_ids = engine.encode(PROMPT, chat=False)
        _JOINTS[key] = ExactJoint(models[0], prompt_ids, params, N)
    return _JOINTS[key]


def ssd_spec(engine: Engine, **kw) -> SpecConfig:
    kw.setdefault("fan_out", FAN)
    kw.setdefault("fan_out_miss", FAN)
    return SpecConfig(mode=Mode.SSD, k=K, draft=engine.config.spec.draft, **kw)


# ----------------------------------------------------------------- lossless modes
def test_exact_reference_is_a_distribution(engine, models):
    joint = exact_joint(engine, models, T1)
    assert abs(joint.probs.sum() - 1.0) < 1e-6
    assert (joint.probs >= 0).all()
    # low entropy: most of the mass sits in enumerated triples with >= 5 expected counts
    assert joint.probs[joint.probs * N >= 5].sum() > 0.5


def test_ar_matches_exact_joint(engine, models):
    """The harness itself: plain AR sampling follows the computed joint."""
    joint = exact_joint(engine, models, T1)
    done, _ = sample_outputs(engine, SpecConfig(mode=Mode.AR), replace(T1, seed=11))
    assert_distribution(joint.categories(done.outputs), joint.probs, what="AR")


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sd_matches_exact_joint(engine, models, top_p):
    params = replace(T1, top_p=top_p, seed=12)
    joint = exact_joint(engine, models, params)
    spec = SpecConfig(mode=Mode.SD, k=K, draft=engine.config.spec.draft)
    done, _ = sample_outputs(engine, spec, params)
    s = done.stats
    assert 0.2 < s["acceptance_rate"] < 0.9  # the draft differs: rejections are common
    assert_distribution(joint.categories(done.outputs), joint.probs, what=f"SD top_p={top_p}")


@pytest.mark.parametrize("mode", [Mode.SD, Mode.SSD])
def test_rows_that_sample_differently_share_a_batch_losslessly(engine, models, mode):
    """Served together in one batch (Engine.serve), rows at T = 1 and rows at T = 0.6: in
    SD each draws from its own warp of the draft model, in SSD the worker pre-speculates
    with the first setting's; either way the T = 0.6 rows (not the batch's first setting)
    follow the exact joint."""
    from ssdlocal.core.events import TokensEvent
    from ssdlocal.engine.request import Inbox
    from ssdlocal.core.sequence import Request

    params = replace(T1, temperature=0.6, seed=13)
    joint = exact_joint(engine, models, params)
    prompt = tuple(engine.encode(PROMPT, chat=False))
    hot = [Request(prompt, replace(params, temperature=1.0)) for _ in range(N // 4)]
    cool = [Request(prompt, params) for _ in range(N)]
    inbox = Inbox()
    inbox.add(*hot, *cool)
    inbox.close()
    tokens: dict[int, list[int]] = {}
    seated: list[int] = []
    seatings: list[int] = []
    spec = SpecConfig(mode=Mode.SD, k=K, draft=engine.config.spec.draft) if mode is Mode.SD else ssd_spec(engine)
    for event in engine.serve(inbox, max_batch=len(hot) + len(cool), spec=spec):
        if hasattr(event, "joined"):
            seated = list(event.requests)
            seatings.append(len(seated))
        elif isinstance(event, TokensEvent):
            tokens.setdefault(seated[event.row], []).extend(event.token_ids)
    assert seatings[0] == len(hot) + len(cool)  # they started as one batch
    outputs = [type("Out", (), {"token_ids": tuple(tokens[r.id])})() for r in cool]
    assert_distribution(joint.categories(outputs), joint.probs, what=f"{mode.value}, rows of two temperatures")


SSD_CASES = {
    "jit": {"backup": "jit"},
    "ngram": {"backup": "ngram"},
    "none": {"backup": "none"},
    "suffix": {"backup": "suffix"},  # also seeds branches with suffix guesses
    "saguaro-c0.5": {"backup": "jit", "saguaro_c": 0.5},
    "top-p0.9": {"backup": "jit"},
}


@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_matches_exact_joint(engine, models, case):
    params = replace(T1, seed=100 + list(SSD_CASES).index(case))
    if case == "top-p0.9":
        params = replace(params, top_p=0.9)
    joint = exact_joint(engine, models, params)
    spec = ssd_spec(engine, **SSD_CASES[case])
    done, rounds = sample_outputs(engine, spec, params)
    s = done.stats
    # both SSD paths ran in round 1: some rows were served from the cache, some missed
    round1 = rounds[1] if len(rounds) > 1 else None
    assert round1 is not None
    assert 0 < sum(round1.ssd.cache_hit) < len(round1.ssd.cache_hit)
    assert s["backup_used"].get(spec.backup, 0) >= 1
    assert 0 < s["cache_hit_rate"] < 1
    assert_distribution(joint.categories(done.outputs), joint.probs, what=f"SSD {case}")


# ----------------------------------------------------------------- the test can fail
def _bonus_from_p(p, draft_tokens, q, generator, n_draft=None) -> Verdict:
    """Broken: correct acceptance, but the bonus is drawn from p even after a rejection."""
    verdict = verify(p, draft_tokens, q, generator, n_draft)
    rows = torch.arange(p.shape[0])  # [B]
    bonus = sample(p[rows, verdict.n_accepted], generator)  # [B]
    return Verdict(verdict.n_accepted, bonus)


def _accept_argmax(p, draft_tokens, q, generator, n_draft=None) -> Verdict:
    """Broken: accept a draft when it equals argmax p (the greedy rule) at T > 0."""
    batch, k = draft_tokens.shape
    if n_draft is None:
        n_draft = torch.full((batch,), k, dtype=torch.long)
    real = torch.arange(k).unsqueeze(0) < n_draft.unsqueeze(1)  # [B, K]
    accept = (p[:, :k].argmax(-1) == draft_tokens) & real  # [B, K]
    n_acc = torch.cumprod(accept.long(), dim=-1).sum(-1)  # [B]
    bonus = sample(p[torch.arange(batch), n_acc], generator)  # [B]
    return Verdict(n_acc, bonus)


@pytest.mark.parametrize("broken", [_bonus_from_p, _accept_argmax], ids=["bonus-from-p", "argmax"])
def test_broken_verify_is_detected(engine, models, monkeypatch, broken):
    """The same harness rejects a lossy verification (every mode verifies through
    core.verify.verify_logits, which calls `verify` at T > 0)."""
    monkeypatch.setattr(verify_mod, "verify", broken)
    params = replace(T1, seed=31)
    joint = exact_joint(engine, models, params)
    sd = SpecConfig(mode=Mode.SD, k=K, draft=engine.config.spec.draft)
    done, _ = sample_outputs(engine, sd, params)
    assert_not_distribution(joint.categories(done.outputs), joint.probs, what=f"SD {broken.__name__}")


def test_wrong_reference_is_detected(engine, models):
    """Sensitivity: samples at T=1 do not pass against the joint at T=0.9."""
    joint_t = exact_joint(engine, models, replace(T1, temperature=0.9))
    done, _ = sample_outputs(engine, SpecConfig(mode=Mode.AR), replace(T1, seed=41))
    assert chi_square_pvalue(joint_t.categories(done.outputs), joint_t.probs) < 1e-4


# ----------------------------------------------------------------- suffix and hybrid
def _prime_memory(engine: Engine, joint_probs_first: list[int]) -> None:
    """Earlier 'answers' that continue the prompt: for likely first tokens a continuation,
    so suffix proposals exist in rounds 0 and 1 (some right, some wrong)."""
    from ssdlocal.speculation.suffix import SuffixMemory

    prompt_ids = engine.encode(PROMPT, chat=False)
    engine.suffix_memory = SuffixMemory()
    for i, t1 in enumerate(joint_probs_first):
        engine.suffix_memory.add(prompt_ids + [t1, (t1 * 7 + i) % 200 + 5, (t1 * 3) % 200 + 5])


def _likely_firsts(engine: Engine, n: int) -> list[int]:
    done, _ = sample_outputs(engine, SpecConfig(mode=Mode.AR), replace(T1, seed=51))
    counts: dict[int, int] = {}
    for o in done.outputs:
        counts[o.token_ids[0]] = counts.get(o.token_ids[0], 0) + 1
    return sorted(counts, key=counts.get, reverse=True)[:n]


@pytest.mark.parametrize("kind", ["suffix", "suffix-adaptive", "hybrid", "hybrid-adaptive"])
def test_suffix_and_hybrid_match_exact_joint(engine, models, kind):
    """Point-mass suffix proposals (from a primed memory), alone or mixed per row with the
    draft model's sampled proposals, K pinned or chosen per round: still the exact joint."""
    from ssdlocal.core.config import SuffixDraft

    params = replace(T1, seed=60 + ["suffix", "suffix-adaptive", "hybrid", "hybrid-adaptive"].index(kind))
    joint = exact_joint(engine, models, params)
    _prime_memory(engine, _likely_firsts(engine, 3))
    # what K per round would have learned where suffix proposals pay: flat step costs and
    # trusted suffix matches (the choices change which drafts are verified, never the output)
    engine.costs.seed_widths({1: 1.0, 2: 1.0, 3: 1.0})
    engine.acceptance_rates.update({"model": 0.3, "suffix:2": 0.95, "suffix:4": 0.95, "suffix:8": 0.95})
    draft = SuffixDraft() if kind.startswith("suffix") else engine.config.spec.draft
    spec = SpecConfig(mode=Mode.SD, k=K, draft=draft, adaptive_k=kind.endswith("adaptive"))
    done, rounds = sample_outputs(engine, spec, params)
    sources = {s for r in rounds for s in (r.sources or ())}
    assert "suffix" in sources and (kind.startswith("suffix") or "model" in sources or kind.endswith("adaptive"))
    suffix_rows = [(n, a) for r in rounds for n, a, s in zip(r.n_drafted, r.n_accepted, r.sources) if s == "suffix"]
    assert any(a == 0 for _, a in suffix_rows) and any(a > 0 for _, a in suffix_rows)  # both outcomes ran
    assert_distribution(joint.categories(done.outputs), joint.probs, what=f"SD {kind}")


# ----------------------------------------------------------------- the prefix cache
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun. Once upon a time"


@pytest.mark.parametrize("mode", [Mode.AR, Mode.SD, Mode.SSD])
def test_reused_prefixes_keep_the_exact_joint(engine, models, mode):
    """Rows that start from a prefix an earlier call left in the caches (the target's, the
    in-process draft's, the SSD worker's) still sample the exact joint."""
    prompt_ids = engine.encode(LONG_PROMPT, chat=False)
    assert len(prompt_ids) > 2 * 16  # at least two blocks of the cache
    params = replace(T1, seed=61 + [Mode.AR, Mode.SD, Mode.SSD].index(mode))
    key = ("long", params.temperature, params.top_k, params.top_p)
    if key not in _JOINTS:
        _JOINTS[key] = ExactJoint(models[0], prompt_ids, params, N)
    joint = _JOINTS[key]
    spec = {
        Mode.AR: SpecConfig(mode=Mode.AR),
        Mode.SD: SpecConfig(mode=Mode.SD, k=K, draft=engine.config.spec.draft),
        Mode.SSD: ssd_spec(engine, backup="jit"),
    }[mode]
    list(engine.generate([prompt_ids], params, spec=spec))  # leaves the prompt in the caches
    outputs = None
    for ev in engine.generate([prompt_ids] * N, params, spec=spec):
        if isinstance(ev, DoneEvent):
            outputs, stats = ev.outputs, ev.stats
    assert stats["cached_prompt_tokens"] == N * ((len(prompt_ids) - 1) // 16 * 16)
    assert_distribution(joint.categories(outputs), joint.probs, what=f"{mode.value} with reused prefixes")
