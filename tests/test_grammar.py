"""The grammar engine's adapter: compiling (errors that name what cannot be enforced, the
size and time bounds, the bounded cache) and the per-row matchers walked along proposals
(masks per position, rollback of what a round rejected, EOS past the end, masked drafts)."""

from __future__ import annotations

import time

import pytest
import torch

from ssdlocal.grammar.compiler import GrammarCompiler, GrammarError, GrammarLimits
from ssdlocal.grammar.guide import Guides, RowGuide, unpack

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir["llama"])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 384, [0])


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_schemas_with_features_the_engine_cannot_enforce_are_refused_by_name(compiler):
    for schema, feature in (
        ({"type": "object", "not": {"required": ["a"]}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ):
        with pytest.raises(GrammarError) as info:
            compiler.json_schema(schema)
        assert info.value.reason == "unsupported" and feature in info.value.message
    with pytest.raises(GrammarError) as info:
        compiler.json_schema({"type": "foo"})
    assert info.value.reason == "invalid" and "foo" in info.value.message
    with pytest.raises(GrammarError):
        compiler.regex("(unclosed")
    with pytest.raises(GrammarError):
        compiler.json_schema(["not", "a", "schema"])


def test_size_and_time_limits(tokenizer):
    small = GrammarCompiler(tokenizer, 384, [0], GrammarLimits(max_chars=40))
    with pytest.raises(GrammarError) as info:
        small.json_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9)}})
    assert info.value.reason == "too_large"
    hasty = GrammarCompiler(tokenizer, 384, [0], GrammarLimits(compile_timeout_s=0.05))
    compile_now = hasty._compile
    hasty._compile = lambda *a: (time.sleep(0.5), compile_now(*a))[1]  # a grammar that compiles slowly
    with pytest.raises(GrammarError) as info:
        hasty.json_schema({"type": "object"})
    assert info.value.reason == "too_slow" and "0.05 s" in info.value.message
    hasty._compile = compile_now
    assert hasty.json_schema({"type": "object"}).kind == "json_schema"  # the next one is fine


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(tokenizer):
    compiler = GrammarCompiler(tokenizer, 384, [0], GrammarLimits(cache_entries=2))
    first = compiler.regex("[a-z]+")
    assert compiler.regex("[a-z]+") is first and compiler.hits == 1
    compiler.regex("[0-9]+")
    compiler.regex("x+")  # evicts the least recently used
    assert len(compiler._cache) == 2 and compiler.regex("[a-z]+") is not first


def test_a_row_guide_masks_each_position_and_rolls_back(compiler, tokenizer):
    grammar = compiler.regex("(abc|abd)e")
    guide = RowGuide(grammar.matcher(), 384, [0])
    path = ids(tokenizer, "a") + ids(tokenizer, "b") + ids(tokenizer, "c") + ids(tokenizer, "e")
    bad = ids(tokenizer, "x")[0]
    assert guide.walk(path[:2] + [bad]) == 2  # stops before the forbidden token
    assert not guide.allows(guide.masks[2], bad) and guide.allows(guide.masks[2], path[2])
    assert guide.walk(path) == 4  # reuses the first two, goes on
    assert guide.allows(guide.masks[4], 0)  # complete: EOS allowed
    assert guide.walk(path[:1]) == 1  # rolled back to one token
    assert guide.walk(path) == 4
    guide.commit(path[:3])  # the round kept three tokens
    assert guide.walked == [] and len(guide.masks) == 1
    assert guide.allows(guide.masks[0], path[3]) and not guide.allows(guide.masks[0], path[2])
    with pytest.raises(RuntimeError):
        guide.commit([bad])
    guide.commit([path[3], 0])  # EOS ends the grammar; past it only EOS (ignore_eos)
    assert unpack(guide.masks[0], 384).nonzero().flatten().tolist() == [0]
    guide.commit([0, 0])


def test_guides_give_rows_their_own_masks(compiler, tokenizer):
    digits, letters = compiler.regex("[0-9]+"), compiler.regex("[a-z]+")
    guides = Guides([digits, None, letters, digits], 384, [0])
    one, a = ids(tokenizer, "1")[0], ids(tokenizer, "a")[0]
    allowed = guides.allowed([[one, a], [a], [a, one], [one, one]], 2, [True, True, True, False], "cpu")
    assert allowed.shape == (4, 3, 384)
    assert allowed[0, 0, one] and not allowed[0, 0, a] and not allowed[0, 0, 0]  # EOS only after a digit
    assert allowed[0, 1, one] and not allowed[0, 1, a] and allowed[0, 1, 0]
    assert allowed[0, 2].all()  # past the forbidden draft (a): left open, never reached
    assert allowed[1].all() and allowed[3].all()  # no grammar; an idle row
    assert allowed[2, 0, a] and not allowed[2, 0, one]
    guides.commit([[one], [a], [a], []], [True, True, True, False])
    assert guides.rows[0].walked == [] and guides.rows[3].walked == []
    seconds = guides.take_seconds()
    assert seconds[1] == 0.0 and seconds[0] > 0 and guides.take_seconds()[0] == 0.0


def test_draft_masks_are_the_masks_verification_reuses(compiler, tokenizer):
    grammar = compiler.regex("[a-c]+")
    guides = Guides([grammar], 384, [0])
    a, b = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    m0 = guides.draft_allowed(0, None, [True], "cpu")
    m1 = guides.draft_allowed(1, torch.tensor([a]), [True], "cpu")
    assert m0[0, a] and m1[0, b] and guides.rows[0].walked == [a]
    fills = len(guides.rows[0].masks)
    allowed = guides.allowed([[a, b]], 2, [True], "cpu")
    assert allowed[0, 0].equal(m0[0]) and allowed[0, 1].equal(m1[0])
    assert len(guides.rows[0].masks) == fills + 1  # one more mask: the position after d_2


def test_the_model_drafter_drafts_what_the_grammar_allows(tiny_dir, compiler, tokenizer):
    from ssdlocal.backends import registry
    from ssdlocal.core.config import ModelSpec, SamplingParams
    from ssdlocal.draft.decode import Drafting
    from ssdlocal.draft.sync import ModelDrafter
    from support.drafts import row_views

    runner = registry.make_runner(registry.load(ModelSpec(str(tiny_dir["draft_llama"]), dtype="float32")))
    grammar = compiler.regex("[0-9]{1,9}")
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)):
        guides = Guides([grammar, None], 384, [0])
        drafter = ModelDrafter(Drafting(runner, 4, params, 384), "cpu", guides=guides)
        drafter.reserve(2, 64)
        drafter.start(row_views(ids(tokenizer, "the cat 1"), ids(tokenizer, "the cat 2")))
        proposal = drafter.propose([True, True])
        drafts = proposal.drafts.tolist()
        assert tokenizer.decode(drafts[0]).isdigit(), tokenizer.decode(drafts[0])
        assert guides.rows[0].walk(drafts[0]) == 4
        if proposal.q is not None:  # q is the masked distribution the drafts came from
            allowed = unpack(torch.stack(guides.rows[0].masks[:4]), 384)  # [4, V]
            assert float(proposal.q[0][~allowed].sum()) == 0.0
            assert torch.allclose(proposal.q[0].sum(-1), torch.ones(4))


def _alive(pid: int) -> bool:
    import os

    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_compile_past_the_limit_is_killed_and_the_queue_is_bounded(tokenizer):
    """Issue 33 item 6: a refused compile stops using CPU and memory (its child process is
    killed), a fresh child serves the next one, and compiles past the pool's queue are
    refused at once as busy."""
    import threading

    from support.grammar_children import hanging_serve

    from ssdlocal.grammar.pool import CompilePool

    pool = CompilePool(tokenizer, 384, [0], workers=1, queue=1, serve=hanging_serve)
    try:
        pool.start()
        first = pool.pids()
        with pool.slot(1.0):
            pool.check("regex", "fine", 60)  # waits for the child to start
        started = time.perf_counter()
        with pytest.raises(GrammarError) as info, pool.slot(1.0):
            pool.check("regex", "HANG forever", 0.5)
        assert info.value.reason == "too_slow" and time.perf_counter() - started < 10
        assert pool.killed == 1 and not _alive(first[0]) and pool.pids() != first
        outcomes, holding = [], threading.Event()

        def hold():
            with pool.slot(1.0):
                holding.set()
                try:
                    pool.check("regex", "HANG again", 3.0)
                except GrammarError as exc:
                    outcomes.append(exc.reason)

        def wait():
            try:
                with pool.slot(10.0):
                    outcomes.append("ran")
            except GrammarError as exc:
                outcomes.append(exc.reason)

        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(30)
        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.perf_counter() + 5
        while pool._waiting == 0 and time.perf_counter() < deadline:
            time.sleep(0.01)
        with pytest.raises(GrammarError) as busy, pool.slot(10.0):
            pass  # one waits already: the queue (1) is full
        assert busy.value.reason == "busy"
        holder.join(30)
        waiter.join(30)
        assert sorted(outcomes) == ["ran", "too_slow"] and pool.killed == 2
    finally:
        pool.close()
    assert not any(_alive(pid) for pid in first + pool.pids())


def test_deep_schemas_ref_cycles_and_a_vocabulary_smaller_than_the_tokenizer_say_what_is_wrong(tokenizer, compiler):
    """Issue 33 item 8."""
    from ssdlocal.core.errors import UsageError

    deep = {"type": "string"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError) as info:
        compiler.json_schema(deep)
    assert "nested more than" in info.value.message and info.value.reason == "too_large"
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    with pytest.raises(GrammarError) as info:
        compiler.json_schema(cycle)
    assert "cycle" in info.value.message and "#/$defs/a -> #/$defs/b -> #/$defs/a" in info.value.message
    recursive = {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}}
    assert compiler.json_schema(recursive).kind == "json_schema"  # recursion that reaches a value is fine
    small = GrammarCompiler(tokenizer, len(tokenizer) - 1, [0])
    with pytest.raises(UsageError) as usage:
        small.regex("a")
    assert "vocab_size" in usage.value.message and "config.json" in usage.value.hint


def test_patterns_whose_counted_repetitions_explode_are_refused_at_compile_time(compiler):
    """Issue 33 item 3, where it can be known before any token: nested counted repetitions
    (the engine's lexer gives up on them mid-answer) are refused when compiled."""
    nested = "^(((a{1,100}){1,100}){1,100}){1,100}$"
    for compile_it in (
        lambda: compiler.regex(nested),
        lambda: compiler.json_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": nested}}}),
    ):
        with pytest.raises(GrammarError) as info:
            compile_it()
        assert info.value.reason == "too_slow" and "repetitions" in info.value.message
    assert compiler.regex(r"^[a-z0-9]{1,64}(\.[a-z0-9]{1,64}){0,10}$").kind == "regex"  # ordinary counts pass


def test_a_compile_while_the_start_is_still_awaited_reads_its_own_answer(tokenizer):
    """serve's warm-up thread waits for the children's start (CompilePool.wait_started)
    while a request may already compile on one of them: the two must not read the child's
    socket side by side (a compile then read an empty message, "its compile crashed", and a
    second server in one process failed every grammar)."""
    import threading

    from ssdlocal.grammar.pool import CompilePool

    def compile_twice(pool, done):
        for text in ("fine", "again"):  # the first waits for the start beside wait_started
            with pool.slot(5.0):
                pool.check("regex", text, 20)
        done.append(True)

    for _ in range(3):
        pool, done = CompilePool(tokenizer, 384, [0], workers=1, queue=1), []
        try:
            pool.start()
            waiter = threading.Thread(target=pool.wait_started, daemon=True)
            waiter.start()
            compiling = threading.Thread(target=compile_twice, args=(pool, done), daemon=True)
            compiling.start()
            compiling.join(40)  # before: it read the child's answer beside the waiter and hung
            assert done == [True]
            waiter.join(10)
            assert not waiter.is_alive()
        finally:
            pool.close()
