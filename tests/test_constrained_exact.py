"""Constrained decoding at temperature 0: every mode gives constrained AR's tokens exactly.

Under a grammar the target's distribution at a position is its p masked to what the grammar
allows after everything before that position. Greedy SD (the draft masked too, or K chosen
per round with suffix proposals), n-gram and suffix drafts (point masses, not masked) and
SSD (its worker drafts without the grammar; the target masks every drafted position) must
all emit constrained AR's tokens, and those tokens must follow the grammar. fp32 tiny models.
Also: grammars of different rows in one batch never mix (each row equals its answer alone),
an answer the grammar completes ends with EOS, and one cut by the budget ends "length".
"""

from __future__ import annotations

import pytest
import torch

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, RoundEvent, TokensEvent
from ssdlocal.engine import Engine
from ssdlocal.grammar.compiler import GrammarCompiler
from ssdlocal.grammar.guide import Guides, unpack
from support.drafts import draft_of

pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "the cat"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
WORDS = r"[a-f]+( [a-f]+)*|[g-z]+( [g-z]+)*"  # the first token picks the letters of every later one
PROMPTS = ['{"name": "the cat", "tags": ["a", "bb"]} {"name": "the', "the cat sat on the mat, the cat", "fed a bad"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    cfg = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(tiny_dir["draft_llama"]))),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        yield eng


@pytest.fixture(scope="module")
def compiler(engine):
    return GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)


@pytest.fixture(scope="module")
def grammars(compiler):
    return [compiler.json_schema(SCHEMA), None, compiler.regex(WORDS)]


def run(engine, prompts, spec, grammars, params=GREEDY):
    done, rounds = None, []
    for ev in engine.generate(prompts, params, spec=spec, grammars=grammars):
        if isinstance(ev, RoundEvent):
            rounds.append(ev)
        elif isinstance(ev, DoneEvent):
            done = ev
    return done, rounds


def follows(grammar, tokens, eos_ids) -> bool:
    """The tokens are a prefix the grammar allows (a final EOS only where it may end)."""
    matcher = grammar.matcher()
    body = list(tokens)
    if body and body[-1] in eos_ids:
        body.pop()
        return matcher.consume_tokens(body) and matcher.is_accepting()
    return matcher.consume_tokens(body) if body else True


SPECS = {
    "sd-k2": dict(mode=Mode.SD, k=2),
    "sd-k3-model-only": dict(mode=Mode.SD, k=3, suffix=False),
    "sd-adaptive": dict(mode=Mode.SD, k=4, adaptive_k=True),
    "ngram": dict(mode=Mode.SD, k=4, draft="ngram"),
    "suffix": dict(mode=Mode.SD, k=4, draft="suffix"),
    "ssd-jit": dict(mode=Mode.SSD, k=2, backup="jit", fan_out=(2, 2, 2)),
    "ssd-ngram": dict(mode=Mode.SSD, k=2, backup="ngram", fan_out=(1, 1, 2)),
    "ssd-none": dict(mode=Mode.SSD, k=2, backup="none"),
}


def make_spec(engine, tiny_dir, case: str) -> SpecConfig:
    kw = dict(SPECS[case])
    draft = kw.pop("draft", str(tiny_dir["draft_llama"]))
    suffix = kw.pop("suffix", True)
    return SpecConfig(draft=draft_of(draft, suffix=suffix), **kw)


@pytest.mark.parametrize("case", list(SPECS))
def test_constrained_modes_equal_constrained_ar(engine, grammars, tiny_dir, case):
    ar, _ = run(engine, PROMPTS, SpecConfig(mode=Mode.AR), grammars)
    out, rounds = run(engine, PROMPTS, make_spec(engine, tiny_dir, case), grammars)
    for b, (a, o) in enumerate(zip(ar.outputs, out.outputs)):
        assert o.token_ids == a.token_ids, f"{case}: row {b} diverges from constrained AR"
        assert o.finish_reason == a.finish_reason
    for b, g in enumerate(grammars):
        if g is not None:
            assert follows(g, out.outputs[b].token_ids, engine.eos_ids), f"{case}: row {b} breaks its grammar"
    unconstrained, _ = run(engine, PROMPTS[1:2], SpecConfig(mode=Mode.AR), None)
    assert out.outputs[1].token_ids == unconstrained.outputs[0].token_ids  # row 1 has no grammar
    assert out.outputs[2].token_ids != run(engine, PROMPTS[2:], SpecConfig(mode=Mode.AR), None)[0].outputs[0].token_ids
    stats = out.stats
    assert stats["constrained"] is True and stats["mask_ms_per_token"] > 0
    assert 0 <= stats["constrained_acceptance_rate"] <= 1
    assert any(
        r.grammar is not None and r.grammar.constrained == tuple(grammars[b] is not None for b in r.rows)
        for r in rounds
    )


def test_each_row_keeps_its_own_grammar(engine, grammars, compiler, tiny_dir):
    """Three grammars (and none) in one batch: every row equals that row run alone, in AR
    and SD, and two rows with the same grammar hold separate matchers."""
    words = grammars[2]
    prompts = PROMPTS + [PROMPTS[2]]
    mixed = [grammars[0], None, words, words]
    for spec in (SpecConfig(mode=Mode.AR), make_spec(engine, tiny_dir, "sd-k2")):
        together, _ = run(engine, prompts, spec, mixed)
        for b, (prompt, g) in enumerate(zip(prompts, mixed)):
            alone, _ = run(engine, [prompt], spec, [g])
            assert together.outputs[b].token_ids == alone.outputs[0].token_ids, f"row {b} ({spec.mode})"


def test_a_completed_grammar_ends_the_answer_and_a_cut_one_says_length(engine, compiler, tiny_dir):
    yes_no = compiler.regex("(yes|no)")
    for spec in (
        SpecConfig(mode=Mode.AR),
        make_spec(engine, tiny_dir, "sd-k3-model-only"),
        make_spec(engine, tiny_dir, "ngram"),
    ):
        done, _ = run(engine, ["Is it? ", "Well"], spec, [yes_no, yes_no])
        for o in done.outputs:
            assert o.text in ("yes", "no") and o.finish_reason == "eos", o
        cut, _ = run(engine, ["Well"], spec, [compiler.json_schema(SCHEMA)], SamplingParams(max_new_tokens=3))
        assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 3


def test_masking_every_position_like_the_first_is_caught(engine, grammars, tiny_dir, monkeypatch):
    """The harness fails a verification that masks every drafted position with the first
    position's mask (drafts the grammar forbids after the prefix get accepted)."""

    def first_mask_only(self, drafts, width, active, device):
        rows = [[] for _ in drafts]
        words = torch.full((len(drafts), width + 1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for b, guide in enumerate(self.rows):
            if guide is not None and active[b]:
                guide.walk(rows[b])
                words[b, :] = guide.masks[0]
        return unpack(words.to(device), self.vocab_size)

    ar, _ = run(engine, PROMPTS, SpecConfig(mode=Mode.AR), grammars)
    monkeypatch.setattr(Guides, "allowed", first_mask_only)
    broken = []
    for case in ("ngram", "ssd-none"):
        try:
            out, _ = run(engine, PROMPTS, make_spec(engine, tiny_dir, case), grammars)
        except RuntimeError as exc:  # a committed token the grammar forbids
            broken.append(str(exc))
            continue
        broken += [b for b in (0, 2) if out.outputs[b].token_ids != ar.outputs[b].token_ids]
    assert broken, "masking only the first position went unnoticed"


NESTED = "(((a{1,100}){1,100}){1,100}){1,100}"  # compiles, then the engine's lexer gives up on it


def fresh(compiler, kind: str, text: str):
    """A grammar compiled anew (no cache, no compile-time screening): its lexer starts empty."""
    return compiler._compile(kind, text, f"{kind}:{text}", compiler._tokenizer())


@pytest.mark.parametrize("case", ["ar", "sd-k2", "ngram", "ssd-none"])
def test_a_grammar_the_engine_cannot_continue_ends_its_row_only(engine, grammars, compiler, tiny_dir, case):
    """Issue 33 items 3-4: a row whose grammar fails mid-answer ends with finish_reason
    "error", an EOS and the engine's message (where it fails may depend on the drafts: the
    engine's lexer is shared by the grammar's matchers); the other rows of its batch
    (constrained or not) equal their answers alone, and AR's."""
    optional = "a?" * 2000 + "a" * 2000  # this one fails as the string begins
    schema = '{"type":"object","properties":{"s":{"type":"string","pattern":"^' + optional + '$"}},"required":["s"]}'
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompts = ["a a a", PROMPTS[1], PROMPTS[2], '{"s": "']

    def rows():
        return [fresh(compiler, "regex", NESTED), None, grammars[2], fresh(compiler, "json_schema", schema)]

    spec = SpecConfig(mode=Mode.AR) if case == "ar" else make_spec(engine, tiny_dir, case)
    errors, out = {}, None
    for ev in engine.generate(prompts, params, spec=spec, grammars=rows()):
        if isinstance(ev, TokensEvent) and ev.finish_reason is not None:
            errors[ev.row] = ev.error
        elif isinstance(ev, DoneEvent):
            out = ev
    ar, _ = run(engine, prompts, SpecConfig(mode=Mode.AR), rows(), params)
    for b in (0, 3):
        o = out.outputs[b]
        assert o.finish_reason == "error" and ar.outputs[b].finish_reason == "error", (b, o)
        assert o.token_ids[-1] in engine.eos_ids and "too many expressions" in errors[b]
    for b in (1, 2):
        alone, _ = run(engine, [prompts[b]], spec, [rows()[b]], params)
        assert out.outputs[b].token_ids == alone.outputs[0].token_ids == ar.outputs[b].token_ids
        assert errors[b] is None
