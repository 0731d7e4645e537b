"""The prefix cache: a call reuses the KV of the longest prefix earlier calls left, and its
answer is the answer of a fresh engine with no cache, token for token (float32).

Unit tests of the block index (matching, leaves-first LRU eviction, nothing visible before
its copy finished) and of the size rules, then one engine per mode and weight format
running a sequence of calls that covers what users do: a chat's next turn, two
conversations interleaved, a prompt that is a strict prefix of a stored one, one that
diverges at its first token, prefixes ending inside a block, a batch of rows, and a cache
so small that it evicts. Each call is compared with a fresh engine without the cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ssdlocal.backends.llamacpp.prefix import StateStore
from ssdlocal.backends.prefix import BLOCK_TOKENS, PrefixIndex, store_tokens
from ssdlocal.core.config import PREFIX_CACHE_TOKENS, EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import OutOfMemoryError, UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of
from support.prefix_calls import SYSTEM, prompt_ids, run_call, run_sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
B = BLOCK_TOKENS


# --------------------------------------------------------------------------- the block index
def _insert(index: PrefixIndex, tokens) -> list:
    written = []
    index.insert(tokens, written.extend)
    return written


def test_a_stored_prefix_is_found_in_whole_blocks():
    index = PrefixIndex(8)
    seq = list(range(3 * B + 5))
    placed = _insert(index, seq)
    assert [p.index for p in placed] == [0, 1, 2]  # the partial fourth block is not stored
    assert len(index.match(seq)) == 3
    assert len(index.match(seq[: 2 * B + 1])) == 2  # a prompt ending inside a block
    assert index.match([999] + seq[1:]) == []  # diverges at its first token
    other = seq[:B] + [7] * (2 * B)
    assert index.match(other) == index.match(seq)[:1]  # shares the first block only
    assert _insert(index, seq) == []  # stored already: nothing to copy


def test_eviction_takes_the_least_recently_used_leaf_and_never_the_path_in_use():
    index = PrefixIndex(4)
    a = [1] * (2 * B)
    b = [2] * (2 * B)
    _insert(index, a)
    _insert(index, b)  # full: a0 a1 b0 b1
    index.match(a)  # a is now more recent than b
    c = [3] * B
    (placed,) = _insert(index, c)
    assert len(index.match(b)) == 1  # b's leaf went first, its root stayed
    assert len(index.match(a)) == 2
    long = [4] * (6 * B)
    placed = _insert(index, long)  # more than fits: evicts others, never its own blocks
    assert 0 < len(placed) <= 4 and len(index.match(long)) == len(placed)
    assert index.report()["evicted_tokens"] > 0


def test_blocks_are_visible_only_after_their_copy_finished():
    index = PrefixIndex(4)

    def fail(placements):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        index.insert([5] * (2 * B), fail)
    assert index.match([5] * (2 * B)) == [] and index.used == 0
    assert len(_insert(index, [5] * (2 * B))) == 2  # its pool blocks are free again


def _churned_pool(monkeypatch, slice_runs: int):
    """A full prefix store of 16-token sequences whose every other block was used again,
    so a long sequence stored next takes every other pool block (the worst scatter), plus
    the cache rows and pool it copies between (2 layers, random k/v)."""
    from ssdlocal.backends.torch import kvcache

    monkeypatch.setattr(kvcache, "SLICE_RUNS_CPU", slice_runs)
    blocks, layers = 64, 2
    index = PrefixIndex(blocks)
    pool = kvcache.KVPool([(2, 4)] * layers, blocks * B, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    caches = [kvcache.KVCache(1, 2, 48 * B, 4, torch.float32, "cpu") for _ in range(layers)]
    for cache in caches:
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))

    def store(tokens):
        index.insert(
            tokens, lambda placed: pool.save(caches, 0, kvcache.runs_of([(p.index, p.number) for p in placed], B))
        )

    singles = [[1000 + i] * B for i in range(blocks)]
    for seq in singles:
        store(seq)
    for seq in singles[::2]:
        index.match(seq)  # the odd ones are now the least recently used
    return index, pool, caches, store


@pytest.mark.parametrize("slice_runs", [4, 0], ids=["cpu-slices", "indexed"])
def test_copies_per_store_and_reuse_do_not_grow_with_fragmentation(monkeypatch, slice_runs):
    from ssdlocal.backends.torch.kvcache import runs_of

    index, pool, caches, store = _churned_pool(monkeypatch, slice_runs)
    seq = list(range(32 * B))  # 32 blocks into 32 scattered pool blocks: 32 runs
    before = [(c.k[0, :, : len(seq)].clone(), c.v[0, :, : len(seq)].clone()) for c in caches]
    pool.copies = 0
    store(seq)
    numbers = index.match(seq)
    assert len(numbers) == 32 and len(runs_of(list(enumerate(numbers)), B)) == 32  # fully scattered
    per_call = 2 * len(caches)  # one copy per layer for k and for v
    assert pool.copies == per_call  # one indexed copy each, not one per run
    for c in caches:
        c.k.zero_(), c.v.zero_()
    pool.copies = 0
    pool.load(caches, 0, runs_of(list(enumerate(numbers)), B))
    assert pool.copies == per_call
    for c, (k, v) in zip(caches, before):
        assert torch.equal(c.k[0, :, : len(seq)], k) and torch.equal(c.v[0, :, : len(seq)], v)
    assert not c.k[0, :, len(seq) :].any()  # nothing written past the prefix


def test_a_chain_evicted_leaf_first_is_stored_again_as_one_run():
    index = PrefixIndex(8)
    old, new = [1] * (8 * B), [2] * (8 * B)
    _insert(index, old)
    placed = _insert(index, new)  # evicts old's blocks 7, 6, .., 0 (leaves first)
    assert [p.number for p in placed] == list(range(8))  # handed out ascending: one copy run


def test_the_size_rules():
    per_token = 1000
    assert store_tokens(None, per_token, None, "x") == PREFIX_CACHE_TOKENS
    assert store_tokens(None, per_token, 10_000_000, "x") == 992  # a tenth of 10 MB, whole blocks
    assert store_tokens(0, per_token, 1, "x") == 0
    assert store_tokens(100, per_token, None, "x") == 96
    with pytest.raises(OutOfMemoryError) as err:
        store_tokens(1_000_000, per_token, 500_000_000, "the target on cpu")
    assert "1,000,000 tokens" in err.value.message and "--prefix-cache-tokens" in err.value.hint
    with pytest.raises(UsageError):
        EngineConfig(target=ModelSpec("x"), prefix_cache_tokens=-1)


def test_llamacpp_states_keep_the_longest_prefixes():
    store = StateStore(tokens=20, entries=2)
    assert store.wanted([1, 2, 3], exact=0)
    store.put([1, 2, 3], b"a", cells=3, exact=0)
    assert not store.wanted([1, 2], exact=0)  # held already by the longer entry
    assert store.wanted([1, 2], exact=2)  # ... but not as exactly
    store.put([1, 2, 3, 4], b"b", cells=4, exact=0)  # extends the first: replaces it
    entry, n = store.best([1, 2, 3, 4, 5])
    assert len(store.entries) == 1 and entry.state == b"b" and n == 4
    assert store.best([1, 2, 3, 4, 5], exact=True) == (None, 0)  # nothing of it is exact
    store.put([9] * 8, b"c", cells=8, exact=8)
    store.put([8] * 12, b"d", cells=12, exact=0)  # over the budget: the least recently used goes
    assert sum(e.cells for e in store.entries.values()) <= 20 and len(store.entries) <= 2
    assert not store.wanted([0] * 21, exact=0)  # larger than the whole budget
    assert store.best([9] * 9, exact=True)[1] == 8


# --------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """The tiny llama and its draft with a 1024-token context."""
    root = tmp_path_factory.mktemp("prefix_models")
    out = {}
    for name in ("llama", "draft_llama"):
        shutil.copytree(tiny_dir[name], root / name)
        config = json.loads((root / name / "config.json").read_text())
        config["max_position_embeddings"] = 1024
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def reference(models):
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), prefix_cache_tokens=0)
    with Engine(config) as engine:
        yield engine


CASES = [
    (Mode.AR, None, "none"),
    (Mode.SD, "model", "none"),
    (Mode.SD, "ngram", "none"),
    (Mode.SD, "suffix", "none"),
    (Mode.SSD, "model", "none"),
    (Mode.AR, None, "int8"),
    (Mode.SD, "model", "int4"),
]


@pytest.mark.parametrize(("mode", "draft", "quantization"), CASES)
def test_every_call_equals_a_fresh_engine_without_the_cache(models, reference, mode, draft, quantization):
    path = models["draft_llama"] if draft == "model" else draft
    target = ModelSpec(models["llama"], dtype="float32", quantization=quantization)
    spec = SpecConfig(
        mode=mode, k=3, draft=draft_of(path, quantization=quantization) if draft else draft_of(None), backup="jit"
    )
    ref_config = EngineConfig(target=target, prefix_cache_tokens=0)
    with Engine(EngineConfig(target=target, spec=spec, pin_cpus=False)) as engine:
        if quantization == "none":
            cached = run_sequence(engine, reference)
        else:  # the quantized reference: the same weights without the cache
            with Engine(ref_config) as ref:
                cached = run_sequence(engine, ref)
        report = engine.prefix_reports()["target"]
    first_turn, next_turn, other, back, prefix, diverged, batch = cached
    assert first_turn == 0 and diverged == 0
    assert next_turn >= len(SYSTEM) + 20 + 10 - B  # all of the last turn but a partial block
    assert other >= len(SYSTEM) // B * B and back > next_turn and prefix == 3 * B and batch > 0
    assert report["used_tokens"] > 0 and report["reused_tokens"] >= sum(cached)


def test_a_cache_too_small_for_the_calls_evicts_and_stays_exact(models, reference):
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), prefix_cache_tokens=4 * B)
    with Engine(config) as engine:
        run_sequence(engine, reference)
        report = engine.prefix_reports()["target"]
    assert report["capacity_tokens"] == 4 * B and report["evicted_tokens"] > 0


def test_off_and_on_give_the_same_tokens_and_off_reads_everything(models, reference):
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), prefix_cache_tokens=0)
    with Engine(config) as engine:
        assert set(run_sequence(engine, reference)) == {0}
        assert engine.prefix_reports() == {}


def test_sampled_answers_with_the_cache_equal_the_ones_without(models):
    """At temperature 1 a seeded call repeats (pinned K): with reused KV the target's
    distributions are the same, so the same draws give the same tokens."""
    spec = SpecConfig(mode=Mode.SD, k=3, draft=draft_of(models["draft_llama"], suffix=False))
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=True)
    prompt = SYSTEM + prompt_ids(8, 10)
    outs = []
    for tokens in (0, None):
        config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), spec=spec, prefix_cache_tokens=tokens)
        with Engine(config) as engine:
            for _ in range(3):  # the second and third calls reuse the first's prefix
                done = [e for e in engine.generate([prompt], params) if isinstance(e, DoneEvent)][0]
                outs.append((done.outputs[0].token_ids, done.stats["cached_prompt_tokens"]))
    assert len({tokens for tokens, _ in outs}) == 1
    assert [c for _, c in outs] == [
        0,
        0,
        0,
        0,
        len(prompt) - 1 - (len(prompt) - 1) % B,
        len(prompt) - 1 - (len(prompt) - 1) % B,
    ]


def test_out_of_memory_while_storing_costs_only_the_reuse(models, monkeypatch, caplog):
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"))
    with Engine(config) as engine:

        def no_memory(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        monkeypatch.setattr(engine.runner.model, "save_prefix", no_memory)
        tokens, _ = run_call(engine, [SYSTEM], 6)
        assert len(tokens[0]) == 6 and "prefix cache was not updated" in caplog.text
        assert engine.prefix_reports()["target"]["used_tokens"] == 0
        monkeypatch.undo()
        run_call(engine, [SYSTEM], 6)
        _, stats = run_call(engine, [SYSTEM], 6)
        assert stats["cached_prompt_tokens"] == (len(SYSTEM) - 1) // B * B


def test_a_cache_that_does_not_fit_is_refused_at_start(models, monkeypatch):
    from ssdlocal.backends.torch import stored

    monkeypatch.setattr(stored, "free_bytes", lambda device: 1 << 20)  # 1 MiB free
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), prefix_cache_tokens=1 << 16)
    with pytest.raises(OutOfMemoryError) as err:  # 65,536 tokens x 512 bytes = 32 MiB
        Engine(config)
    assert "prefix cache of 65,536 tokens needs 32.0 MiB" in err.value.message
    assert "only 1.0 MiB is free" in err.value.message and "--prefix-cache-tokens 1024 or less" in err.value.hint
    with Engine(EngineConfig(target=ModelSpec(models["llama"], dtype="float32"))) as engine:
        assert engine.prefix_tokens == 192  # the default: a tenth of what is free, in whole blocks


def test_forget_prefixes_empties_the_cache(models):
    with Engine(EngineConfig(target=ModelSpec(models["llama"], dtype="float32"))) as engine:
        run_call(engine, [SYSTEM], 4)
        engine.forget_prefixes()
        _, stats = run_call(engine, [SYSTEM], 4)
        assert stats["cached_prompt_tokens"] == 0


def test_the_cli_refuses_a_cache_that_does_not_fit_or_a_bad_size(models, monkeypatch, capsys):
    from support.cli import assert_clean_error, run_cli

    from ssdlocal.backends.torch import stored

    base = (
        "generate",
        "hi",
        "--target",
        models["llama"],
        "--mode",
        "ar",
        "--max-new-tokens",
        "2",
        "--dtype",
        "float32",
    )
    code, _, err = run_cli(monkeypatch, capsys, *base, "--prefix-cache-tokens", "-5")
    assert_clean_error(code, err, 2, "prefix-cache-tokens must be a whole number", "--no-prefix-cache")
    monkeypatch.setattr(stored, "free_bytes", lambda device: 1 << 20)
    code, _, err = run_cli(monkeypatch, capsys, *base, "--prefix-cache-tokens", "65536")
    assert_clean_error(code, err, 1, "needs 32.0 MiB", "--prefix-cache-tokens 1024 or less")
    code, out, _ = run_cli(monkeypatch, capsys, *base, "--no-prefix-cache", "--json")
    assert code == 0 and json.loads(out)["stats"]["prefix_cache"] == {}


def test_captured_steps_read_reused_prefixes_like_eager(models, reference, monkeypatch):
    """SSDLOCAL_GRAPHS=trace replays every decode step as the op graph it captured (stale
    reads give wrong tokens as on a GPU): copies into the KV cache must go in place."""
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "trace")
    spec = SpecConfig(mode=Mode.SD, k=3, draft=draft_of(models["draft_llama"]), backup="jit")
    with Engine(EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), spec=spec, graphs="trace")) as engine:
        cached = run_sequence(engine, reference)
        graphs = engine.runner.graphs.stats.as_dict()
    assert sum(cached) > 0 and graphs["replays"] > 0 and not graphs["dropped"]


@pytest.mark.draft_loss
def test_a_dead_ssd_worker_takes_its_cache_and_the_target_stays_exact(models, reference):
    import os
    import signal

    spec = SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(models["draft_llama"]), backup="jit")
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), spec=spec, pin_cpus=False)
    prompt = SYSTEM + prompt_ids(9, 20)
    with Engine(config) as engine:
        first, _ = run_call(engine, [prompt], 10)
        os.kill(engine.drafts.worker.proc.pid, signal.SIGKILL)
        found, lost = run_call(engine, [prompt + first[0]], 10)  # the call that finds it dead goes on without it
        assert lost.draft_losses == 1 and "died" in lost.draft_lost
        again, stats = run_call(engine, [prompt + first[0]], 10)  # a new worker, an empty draft cache
        want, _ = run_call(reference, [prompt + first[0]], 10)
    assert found == again == want and stats["cached_prompt_tokens"] > len(SYSTEM) // 2
    assert stats.draft_losses == 0


def test_the_ssd_workers_cache_is_reported_as_the_drafts(models):
    spec = SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(models["draft_llama"]), backup="jit")
    config = EngineConfig(target=ModelSpec(models["llama"], dtype="float32"), spec=spec, pin_cpus=False)
    with Engine(config) as engine:
        first, _ = run_call(engine, [SYSTEM], 8)
        _, stats = run_call(engine, [SYSTEM + first[0] + prompt_ids(10, 5)], 8)
    draft = stats["prefix_cache"]["draft"]
    assert draft["reused_tokens"] >= len(SYSTEM) // B * B and draft["stored_tokens"] > 0
