"""The llama.cpp backend without the compiled library: a fake LlamaLib with llama.cpp's
KV-cache semantics (unified cells carrying sequence ids, seq_rm / seq_cp by position
ranges, batch position checks) and logits that are a pure function of the tokens a
query can see. A stale or missing cell changes the logits or trips an assertion, so
these tests check the runner's bookkeeping: AR == SD == SSD token for token through the
Engine, the SSD tree decode and branch hand-over, mixed torch/GGUF pairs, load errors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.cli import run_cli
from support.fake_llamalib import FakeLlamaLib, model_logits, reference_greedy
from support.llamacpp_fakes import GREEDY, PROMPTS, fake, run, tok_dir, tokenizer, vocab  # noqa: F401 - fixtures

from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
from ssdlocal.backends.llamacpp import loader as gguf_loader
from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SpecConfig,
)
from ssdlocal.core.errors import ModelLoadError, SSDLocalError, UsageError
from ssdlocal.core.events import SsdRound
from ssdlocal.draft.base import Proposal
from ssdlocal.draft.ssd.protocol import OutcomeMsg, StartMsg
from ssdlocal.draft.ssd.speculator import Speculator
from ssdlocal.engine import Engine
from ssdlocal.engine.drafts import DraftSide
from ssdlocal.draft.base import DrafterBase
from ssdlocal.core.config import ModelDraft, NgramDraft


# ----------------------------------------------------------------- engine: AR / SD
def test_ar_matches_reference_and_sd_matches_ar(fake, tokenizer, vocab):
    _lib, target, draft = fake
    cfg = EngineConfig(
        target=ModelSpec(target, backend="llamacpp", dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))),
    )
    with Engine(cfg) as eng:
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        for prompt, out in zip(PROMPTS, ar):
            ids = list(tokenizer.encode(prompt))
            assert out == reference_greedy("target.gguf", ids, GREEDY.max_new_tokens, vocab)
        sd, stats = run(eng, PROMPTS)
        assert sd == ar
        assert stats["acceptance_rate"] > 0.3  # the draft shares the bigram table
        ng, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=4, draft=NgramDraft()))
        assert ng == ar
        one, _ = run(eng, PROMPTS[1:2])  # batch 1 after batch 3 reuses the context
        assert one == ar[1:2]


def test_later_calls_start_from_stored_rows_and_match_the_reference(fake, tokenizer, vocab):
    """The prefix cache on llama.cpp: a finished row's cells are saved (its sequence state)
    and a later row sharing its prefix restores them and decodes only the rest. A row alone
    in its call takes whole chunks of a cold read only (N_BATCH tokens each), so the rest is
    read as a cold read reads it; rows of a batch take all they share."""
    from ssdlocal.backends.llamacpp.runner import N_BATCH

    lib, target, draft = fake
    cfg = EngineConfig(
        target=ModelSpec(target, backend="llamacpp", dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))),
    )
    first = [(7 * i) % (vocab - 10) + 5 for i in range(N_BATCH + 88)]
    with Engine(cfg) as eng:
        out, stats = run(eng, [first])
        assert stats["cached_prompt_tokens"] == 0
        follow = first + out[0] + [5, 6, 7]
        ctx = lib.contexts[-1]
        before = ctx.decoded
        again, stats = run(eng, [follow])
        assert stats["cached_prompt_tokens"] == N_BATCH  # the cold read's whole chunk
        assert again[0] == reference_greedy("target.gguf", follow, GREEDY.max_new_tokens, vocab)
        assert lib.contexts[-1] is ctx  # the same context
        assert ctx.decoded - before < len(follow)  # the shared chunk was not decoded again
        both, stats = run(eng, [follow, first + [9]], SpecConfig(mode=Mode.AR))
        assert stats["cached_prompt_tokens"] == len(follow) - 1 + len(first)  # a batch: all it shares
        want = [reference_greedy("target.gguf", p, GREEDY.max_new_tokens, vocab) for p in (follow, first + [9])]
        assert both == want
        assert eng.prefix_reports()["target"]["reused_tokens"] >= N_BATCH + len(follow)


def test_the_store_is_sized_by_the_ram_available(fake, monkeypatch):
    """llama.cpp commits a context's cells when it makes it: the default store takes at
    most a tenth of the RAM available, and an explicit size that does not fit is refused
    with the size asked and what fits."""
    from ssdlocal.backends.llamacpp import stored as runner_mod
    from ssdlocal.backends.prefix import BLOCK_TOKENS
    from ssdlocal.core.errors import OutOfMemoryError

    _lib, target, _ = fake
    runner = LlamaCppRunner(load_gguf(target))
    per_token = runner.loaded.kv_bytes_per_token or 1  # as the runner counts it
    monkeypatch.setattr(runner_mod, "available_ram_bytes", lambda: 10_000 * per_token)
    assert runner.setup_prefix(None) == 1_000 // BLOCK_TOKENS * BLOCK_TOKENS
    assert runner.setup_prefix(4_096) == 4_096
    with pytest.raises(OutOfMemoryError) as err:
        runner.setup_prefix(20_000)
    assert "20,000 tokens" in str(err.value) and "--prefix-cache-tokens" in err.value.hint
    runner.close()


def test_mixed_torch_target_gguf_draft(fake, tiny_dir):
    """torch target + GGUF draft (through the fake): SD reproduces the torch AR."""
    _, _, draft = fake
    cfg = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))),
    )
    with Engine(cfg) as eng:
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        sd, stats = run(eng, PROMPTS)
    assert sd == ar and stats["rounds"] > 0


# ----------------------------------------------------------------- SSD in process
class InProcessSSD(DrafterBase):
    """The worker's Speculator driven in this process (no spawn): same calls, same order."""

    def __init__(self, runner, spec: SpecConfig, params, vocab, num_slots) -> None:
        self.runner, self.spec, self.params, self.vocab, self.num_slots = runner, spec, params, vocab, num_slots
        self.k = spec.k
        self.next = None
        self.hits = 0

    def read_prompts(self, prompts):
        return None

    def store_prefixes(self):
        return None

    def start(self, rows, hidden=None):
        sequences = [row.tokens for row in rows]
        msg = StartMsg(
            tuple(tuple(s) for s in sequences),
            self.params,
            self.k,
            self.num_slots,
            self.vocab,
            self.spec.fan_out,
            self.spec.fan_out_miss,
            self.spec.saguaro_c,
            "jit",
            None,
        )
        self.sp = Speculator(self.runner, msg)
        self.round = 0

    def propose(self, active):
        served = self.sp.first() if self.next is None else self.next
        if self.next is None:
            self.sp.prespeculate()
        self.hits += sum(served.cache_hit)
        return Proposal.from_lists(
            served.tokens, self.k, "cpu", q=served.q, ssd=SsdRound(tuple(served.cache_hit), served.backup)
        )

    def observe(self, outcome):
        if not any(outcome.active):
            return
        msg = OutcomeMsg(self.round, outcome.appended, outcome.n_accepted, outcome.bonus, outcome.active, 0.0, "jit")
        self.round += 1
        self.next = self.sp.resolve(msg)
        self.sp.prespeculate()

    def close(self):
        pass


@pytest.mark.parametrize("draft_name", ["draft", "target"])
def test_ssd_tree_decode_matches_ar(fake, monkeypatch, vocab, draft_name):
    """SSD with a GGUF draft: tree branches live in their own llama.cpp sequences and a
    hit hands the branch's cells to the row. Greedy output == AR; hits happen."""
    _lib, target, draft = fake
    draft_path = target if draft_name == "target" else draft
    drafters = []

    made = DraftSide.make_drafter

    def make_drafter(self, spec, params, offered):
        if spec.mode is not Mode.SSD:
            return made(self, spec, params, offered)
        runner = LlamaCppRunner(load_gguf(draft_path), tree=True)
        drafters.append(InProcessSSD(runner, spec, params, vocab, offered.num_slots))
        return drafters[-1]

    monkeypatch.setattr(DraftSide, "make_drafter", make_drafter)
    cfg = EngineConfig(target=ModelSpec(target, backend="llamacpp", dtype="float32"))
    ssd = SpecConfig(mode=Mode.SSD, k=3, draft=NgramDraft(), fan_out=(2, 2, 1, 3), fan_out_miss=(2, 2, 1, 3))
    with Engine(cfg) as eng:
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        out, _ = run(eng, PROMPTS, ssd)
        assert out == ar
        assert drafters[-1].hits > 0
        one, _ = run(eng, PROMPTS[:1], replace(ssd, k=2, fan_out=None, fan_out_miss=None))
        assert one == ar[:1]


# ----------------------------------------------------------------- runner bookkeeping
@pytest.fixture
def runner(fake):
    lib, target, _ = fake
    return lib, LlamaCppRunner(load_gguf(target), tree=True)


def test_truncated_held_removes_cells(runner):
    lib, r = runner
    r.reset(2, 64)
    r.feed([[1, 2, 3, 4], [5, 6]])
    del r.held[0][2:]  # what a runner.sync after a rejection does
    lib.rm_calls.clear()
    out = r.feed([[9], []])
    assert (0, 2, -1) in lib.rm_calls
    expected = model_logits("target.gguf", [1, 2, 9], lib.vocab)
    assert torch.allclose(out[0][0], torch.from_numpy(expected))
    assert out[1].shape == (0, lib.vocab)
    r.sync(1, [5, 7])
    assert r.held[1] == [5]


def test_a_step_at_a_column_decodes_up_to_it_and_computes_only_its_logits(runner):
    """A catch-up's step (`at`): row b decodes its ids up to column at[b] (the padding past
    it is not decoded), and llama.cpp is asked for that token's logits alone, equal to the
    full step's at that column."""
    lib, r = runner
    r.reset(2, 64)
    r.feed([[1, 2, 3], [4, 5]])
    r.begin_steps()
    ids = torch.tensor([[6, 7, 8], [9, 0, 0]])  # row 1: one real token, then padding
    full = r.step(ids).clone()  # [B, T, V]
    wanted, real = [], lib.decode
    lib.decode = lambda ctx, tokens, pos, seqs, want, v: (
        wanted.append((len(tokens), sum(want))) or real(ctx, tokens, pos, seqs, want, v)
    )
    at = torch.tensor([2, 0])
    got = r.step(ids, at=at)  # the same positions again (lengths did not move)
    assert got.shape == (2, lib.vocab) and wanted == [(4, 2)]  # 3 + 1 tokens, 2 logits
    assert torch.equal(got[0], full[0, 2]) and torch.equal(got[1], full[1, 0])
    r.advance(torch.tensor([3, 1]))
    r.end_steps({0: [6, 7, 8], 1: [9]})
    assert r.feed([[10], [11]], "last")[1].shape == (1, lib.vocab)  # the padding left no cell behind


def test_a_gguf_is_checked_and_its_tokenizer_built_once_per_process(tiny_gguf, tmp_path, monkeypatch):
    """An engine start read each model's tokenizer twice and walked its header three times
    (0.8 s a walk for a 151k vocabulary): in one process a file as it is (path, size,
    mtime) is checked once and gives one tokenizer; a file that changed is checked and
    read again."""
    import os
    import shutil

    from ssdlocal.weights.formats.gguf import GGUFHeader

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf[0], path)
    walks, real = [], GGUFHeader.read.__func__
    monkeypatch.setattr(GGUFHeader, "read", classmethod(lambda cls, p: walks.append(p) or real(cls, p)))
    first = gguf_loader.gguf_tokenizer(path)
    assert gguf_loader.gguf_tokenizer(path) is first and gguf_loader.check_gguf_file(path) == path
    assert len(walks) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    again = gguf_loader.gguf_tokenizer(path)
    assert again is not first and len(walks) == 2
    assert again.encode("the cat") == first.encode("the cat")


def test_model_freed_after_runner(fake):
    import gc

    lib, target, _ = fake
    r = LlamaCppRunner(load_gguf(target))
    r.reset(1, 16)
    ctx = lib.contexts[-1]
    del r
    gc.collect()
    assert ctx.freed and lib.freed_models == ["target.gguf"]


def test_context_reuse_and_growth(runner):
    lib, r = runner
    r.reset(1, 100)
    first = lib.contexts[-1]
    assert first.flash_attn is False  # a CPU context: flash attention off (slower there)
    r.reset(1, 50)  # smaller: same context, cleared
    assert lib.contexts[-1] is first and first.cells == []
    r.reset(4, 300)  # larger: a new one, the old one freed
    assert lib.contexts[-1] is not first and first.freed
    assert lib.contexts[-1].n_ctx >= 1200


def test_long_feed_is_chunked(runner):
    lib, r = runner
    r.reset(1, 1500)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, lib.vocab, 1100)]
    out = r.feed([prompt])[0]
    assert out.shape == (1100, lib.vocab)
    assert torch.allclose(out[-1], torch.from_numpy(model_logits("target.gguf", prompt, lib.vocab)))


def test_forward_raw_rejects_unsupported_masks(runner):
    _lib, r = runner
    r.reset(1, 40)
    r.feed([[1, 2, 3, 4]])
    ids = torch.tensor([[7]])
    mask = torch.zeros(1, 1, 40, dtype=torch.bool)
    mask[0, 0, [0, 2, 30]] = True  # not a prefix of the row
    with pytest.raises(NotImplementedError):
        r.forward_raw(ids, torch.tensor([[2]]), torch.tensor([[30]]), mask)


def test_too_many_branches_is_a_usage_error(fake):
    lib, target, _ = fake
    lib.max_seq = 3
    r = LlamaCppRunner(load_gguf(target), tree=True)
    r.reset(1, 40)
    r.feed([[1, 2]])
    ids = torch.tensor([[4, 5, 6]])
    mask = torch.zeros(1, 3, 40, dtype=torch.bool)
    mask[:, :, :2] = True
    for i, s in enumerate((20, 22, 24)):
        mask[0, i, s] = True
    with pytest.raises(UsageError, match="sequences"):
        r.forward_raw(ids, torch.full((1, 3), 2), torch.tensor([[20, 22, 24]]), mask)


# ----------------------------------------------------------------- load errors
def test_not_a_gguf(tmp_path, fake):
    bad = tmp_path / "model.gguf"
    bad.write_text("not really")
    with pytest.raises(ModelLoadError, match="not a GGUF") as info:
        load_gguf(bad)
    assert "torch" in info.value.hint
    with pytest.raises(ModelLoadError, match="directory"):
        load_gguf(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")


def test_missing_llama_cpp_hint(monkeypatch, fake):
    _, target, _ = fake
    monkeypatch.undo()  # the real LlamaLib, with llama_cpp made unimportable
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ModelLoadError) as info:
        load_gguf(target)
    assert "ssdlocal[llamacpp]" in info.value.hint


def test_gpu_without_gpu_build(fake):
    _, target, _ = fake
    with pytest.raises(ModelLoadError, match="no GPU support"):
        load_gguf(target, "cuda:0")


def test_vocab_mismatch(fake, monkeypatch):
    lib, target, _ = fake
    monkeypatch.setattr(lib, "tokenize", lambda model, text: [1, 2, 3])
    with pytest.raises(ModelLoadError, match="vocabulary mismatch"):
        load_gguf(target)
    monkeypatch.setattr(lib, "vocab", 10)
    with pytest.raises(ModelLoadError, match="vocabulary mismatch"):
        load_gguf(target)


def test_unknown_backend():
    with pytest.raises(UsageError, match="backend"):
        ModelSpec("x.gguf", backend="vllm", dtype="float32")
    assert issubclass(ModelLoadError, SSDLocalError)


def test_package_does_not_import_llama_cpp():
    import subprocess

    code = "import sys, ssdlocal.backends.llamacpp, ssdlocal.engine; assert 'llama_cpp' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_architecture_named(tmp_path, monkeypatch):
    """A GGUF of an architecture transformers' config reader does not know still gets its
    tokenizer (built from the file's own vocabulary, which llama.cpp reads the same way);
    when llama.cpp cannot load the file, the error names its architecture."""
    from support.tiny_gguf import write_tiny_gguf

    from ssdlocal.core.errors import UnsupportedArchitectureError

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, arch="mamba9")
    tok = gguf_loader.gguf_tokenizer(path)
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"

    class Refusing(FakeLlamaLib):
        def load_model(self, path, n_gpu_layers, main_gpu):
            raise ModelLoadError(f"llama.cpp could not load {path}", "upgrade llama-cpp-python")

    with pytest.raises(UnsupportedArchitectureError, match="mamba9"):
        load_gguf(path, lib=Refusing(len(tok.get_vocab()), tok))


def test_cli_backend_options(fake, monkeypatch, capsys, tiny_dir):
    _, target, draft = fake
    base = ["generate", "the cat", "--target", target, "--max-new-tokens", "8", "--json"]
    code, out, err = run_cli(monkeypatch, capsys, *base, "--mode", "ar", "--target-backend", "llamacpp")
    assert code == 0, err
    ar = json.loads(out)
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        *base,
        "--mode",
        "sd",
        "--draft",
        draft,
        "--target-backend",
        "llamacpp",
        "--draft-backend",
        "llamacpp",
    )
    assert code == 0, err
    assert json.loads(out)["outputs"][0]["token_ids"] == ar["outputs"][0]["token_ids"]
    code, _, err = run_cli(monkeypatch, capsys, *base, "--mode", "ar", "--target-backend", "vllm")
    assert code == 2 and "backend" in err
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        "x",
        "--target",
        str(tiny_dir["llama"]),
        "--mode",
        "ar",
        "--target-backend",
        "llamacpp",
    )
    assert code == 1 and "not a .gguf" in err and "hint:" in err


def test_a_larger_batch_takes_the_reading_room_instead_of_a_new_context(runner):
    """Rows and the room to read waiting prompts ahead share the context: a batch that needs
    more cells than it has beside the room, while the room keeps at least half of its own,
    keeps the context; one that needs more makes a new one. Stored rows are saved states
    outside the context: they survive both."""
    lib, r = runner
    room = r.setup_prefix(1000)
    r.reset(1, 310)
    ctx = lib.contexts[-1]
    r.feed([list(range(1, 301))])
    r.store(0, list(range(1, 301)))  # older entry
    r.reset(1, 310)
    r.feed([list(range(60, 360))])
    r.store(0, list(range(60, 360)))  # newer entry
    r.reset(3, 250)  # 750 row cells + the room > the context, but the room keeps over half
    assert lib.contexts[-1] is ctx and not ctx.freed and r._room() >= room // 2
    assert r.reuse(0, list(range(60, 360))) == 300
    assert r.reuse(1, list(range(1, 301))) == 300  # the older one too
    r.reset(2, 700)  # 1400 row cells: the room would keep under half
    assert lib.contexts[-1] is not ctx and ctx.freed
    assert r.reuse(1, list(range(1, 301))) == 300


def test_read_ahead_grows_one_reading_sequence_and_leaves_the_rows_alone(runner, vocab):
    """A waiting prompt goes into the reading sequence a chunk at a time (it grows) while a
    row decodes; the row's logits are those it would get without it; at the next reset it
    goes to the store, and a row seated then takes the tokens read ahead and sees exactly
    its prompt."""
    from ssdlocal.backends.base import Logits

    lib, r = runner
    r.setup_prefix(1000)
    r.reset(1, 200)
    r.feed([[1, 2, 3]])
    r.begin_steps()
    before = r.step(torch.tensor([[4]]))  # row 0's next logits
    prompt = [int(t) % vocab for t in range(10, 110)]
    assert r.read_ahead(prompt, 0) == 0  # a look reads nothing
    assert r.read_ahead(prompt, 32) == 32
    assert r.read_ahead(prompt, 32) == 64
    assert not r.prefix.entries  # one reading sequence grew; nothing stored yet
    assert r.prefix.report()["lookups"] == 0  # looks are not the rows' lookups
    assert torch.equal(r.step(torch.tensor([[4]])), before)
    r.reset(2, 200)
    assert len(r.prefix.entries) == 1  # what was read ahead went to the store
    assert r.reuse(1, prompt) == 64
    last = r.feed([[], prompt[64:]], Logits.LAST)[1]
    assert np.allclose(last[0].numpy(), model_logits(lib.contexts[-1].model, prompt, vocab))
    # a prompt that parts from the stored one part-way starts from its shared cells
    other = prompt[:40] + [5, 6, 7] * 20
    assert r.read_ahead(other, 16) == 56
    r.setup_prefix(16)  # no room to read the prompt: nothing is read
    r.reset(1, 200)
    assert r.read_ahead(prompt, 32) == 0


def test_a_tokenizer_with_the_same_files_is_loaded_once_and_keeps_its_own_template(tiny_gguf, tmp_path, monkeypatch):
    """A draft of the target's family has the target's tokenizer files: the second is a
    copy of the first (0.76 s of each start for the 151k Qwen vocabulary), with its own
    chat template; other files are loaded on their own."""
    import copy
    import json
    import shutil

    import transformers

    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    source = copy.copy(gguf_loader.gguf_tokenizer(tiny_gguf[0]))
    monkeypatch.setattr(gguf_loader, "_BY_FILES", {})
    first_dir, same_dir, other_dir = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    source.chat_template = "{{ 'A' }}"
    source.save_pretrained(first_dir)
    shutil.copytree(first_dir, same_dir)
    (same_dir / "chat_template.jinja").write_text("{{ 'B' }}")
    shutil.copytree(first_dir, other_dir)
    config = other_dir / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    loads, real = [], transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda d, **kw: loads.append(d) or real(d, **kw))
    first, same, other = (gguf_loader._load_cached(d) for d in (first_dir, same_dir, other_dir))
    assert loads == [first_dir, other_dir]  # the second folder's files are the first's
    assert same is not first and same.encode("the cat") == first.encode("the cat")
    assert (first.chat_template, same.chat_template) == ("{{ 'A' }}", "{{ 'B' }}")
    assert other.model_max_length == 77 and other.chat_template == "{{ 'A' }}"


# ----------------------------------------------------------------- a draft that waits
def _auto_engine(target: str, draft: str, alike: bool = True) -> Engine:
    model = ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))
    return Engine(
        EngineConfig(
            target=ModelSpec(target, backend="llamacpp", dtype="float32", batch_invariant=alike),
            spec=SpecConfig(mode=Mode.AUTO, adaptive_k=True, draft=model),
            pin_cpus=False,
        )
    )


def test_auto_on_llama_cpp_kernels_runs_ar_and_loads_the_draft_only_when_asked(fake, monkeypatch):
    """A llama.cpp target on the CPU gives a token other logits in a call of several tokens
    than alone, so `auto` runs AR there (exact, the same every run) and says why; the
    draft model stays unloaded until a call asks for SD. With --batch-invariant steps the
    costs decide as elsewhere (next test)."""
    from ssdlocal.backends import registry

    from ssdlocal.weights import compat

    _lib, target, draft = fake
    monkeypatch.setattr(registry, "context_length", lambda path, name: 4096)
    loads, checks = [], []
    real_load, real_check = registry.load, compat.check_pair
    monkeypatch.setattr(registry, "load", lambda spec, **kw: loads.append(spec.path) or real_load(spec, **kw))
    monkeypatch.setattr(compat, "check_pair", lambda *a, **kw: checks.append(1) or real_check(*a, **kw))
    with _auto_engine(target, draft, alike=False) as eng:
        assert eng.choice.mode is Mode.AR and "llama.cpp's CPU kernels" in eng.choice.line
        assert "the draft model is not loaded (the mode is AR)" in eng.choice.reason
        assert loads == [target] and eng.draft_context == 4096 and not checks  # nor its pair check
        out, stats = run(eng, PROMPTS)
        assert stats["mode"] == "ar" and loads == [target]
        sd, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=3, draft=eng.config.spec.draft))
        assert loads == [target, draft] and len(sd) == len(out) and checks == [1]  # asked for: checked, loaded
        run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=3, draft=eng.config.spec.draft))
        assert checks == [1]  # once


def test_a_mode_that_drafts_checks_the_pair_at_start(fake, monkeypatch):
    from ssdlocal.core.errors import IncompatiblePairError
    from ssdlocal.weights import compat

    _lib, target, draft = fake

    def refuse(*args, **kwargs):
        raise IncompatiblePairError("token text check failed", "use a draft of the target's family")

    monkeypatch.setattr(compat, "check_pair", refuse)
    monkeypatch.setattr("ssdlocal.backends.registry.context_length", lambda path, name: 4096)
    spec = SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32")))
    with pytest.raises(IncompatiblePairError, match="token text check failed"):
        Engine(EngineConfig(target=ModelSpec(target, backend="llamacpp", dtype="float32"), spec=spec))
    with _auto_engine(target, draft, alike=False) as eng:  # auto decodes plainly: no draft, no check yet
        with pytest.raises(IncompatiblePairError):
            run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=3, draft=eng.config.spec.draft))


@pytest.mark.parametrize("pays", [False, True])
def test_a_draft_that_cannot_pay_is_not_loaded_until_asked_for(fake, monkeypatch, pays):
    """`auto` on a CPU with batch-invariant steps: when the kept timings say the draft model cannot pay at any
    acceptance (each scored token costs a plain step; scoring 4 and drafting 3 is slower
    than 4 steps), the engine does not load it; auto calls run without it, with AR's
    output; a call that asks for SD loads it then. A draft that could pay loads at start."""
    from ssdlocal.backends import registry
    from ssdlocal.engine import auto

    _lib, target, draft = fake
    step = 0.01
    widths = {w: step * (1 + 0.02 * (w - 1)) if pays else step * w for w in auto.WIDTHS}
    timings = auto.Calibration(3, widths[1], widths[4], step * (0.05 if pays else 1.0))
    drafted = []
    monkeypatch.setattr(auto, "_pair_calibration", lambda t, d, k, store, key: drafted.append(d) or timings)
    monkeypatch.setattr(auto, "_step_widths", lambda t, store, key: widths)
    monkeypatch.setattr(registry, "context_length", lambda path, name: 4096)  # as the header states (n_ctx_train)
    loads = []
    real_load = registry.load
    monkeypatch.setattr(registry, "load", lambda spec, **kw: loads.append(spec.path) or real_load(spec, **kw))
    with _auto_engine(target, draft) as eng:
        assert eng.choice.mode is Mode.SD and eng.draft_context == 4096
        assert ("the draft model is not loaded" in eng.choice.reason) is not pays
        assert (draft in loads) is pays and (eng.drafts.runner is not None) is pays
        out, _ = run(eng, PROMPTS)
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR))
        assert out == ar and (draft in loads) is pays  # an auto call that cannot use it leaves it
        sd, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.SD, k=3, draft=eng.config.spec.draft))
        assert sd == ar and draft in loads and eng.drafts.runner is not None  # asked for: loaded


def test_a_gguf_states_its_context_without_loading(tiny_gguf, tmp_path):
    from ssdlocal.backends import registry
    from ssdlocal.core.models import BackendName

    path, model = tiny_gguf
    assert registry.context_length(str(path), BackendName.LLAMACPP) == model.config.max_position_embeddings
    assert registry.context_length(str(path), BackendName.TORCH) is None  # torch may scale it
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 60)
    assert registry.context_length(str(junk), BackendName.LLAMACPP) is None  # its load says why


# ----------------------------------------------------------------- a lone row's context grows
def test_a_lone_rows_context_grows_as_it_fills_and_keeps_its_cells(fake, monkeypatch, vocab):
    """A lone row without a prefix store starts in a context of GROW_FROM cells and moves
    to one twice as large whenever it fills it (its cells restored from llama.cpp's
    sequence state), up to what reset asked for; its tokens are the ones a full-size
    context gives. Two rows (or a store, a tree) get the full size at once."""
    from ssdlocal.backends.llamacpp import runner as runner_module

    lib, target, _ = fake
    monkeypatch.setattr(runner_module, "GROW_FROM", 256)
    r = LlamaCppRunner(load_gguf(target))
    r.setup_prefix(0)
    r.reset(1, 1000)
    assert lib.contexts[-1].n_ctx == 256
    prompt = [5, 9, 2, 7] * 50  # 200 tokens
    logits = r.feed([prompt], "last")[0][-1]
    out = []
    while len(prompt) + len(out) < 700:
        out.append(int(torch.argmax(logits)))
        logits = r.feed([[out[-1]]])[0][-1]
    assert out == reference_greedy("target.gguf", prompt, len(out), vocab)
    assert [c.n_ctx for c in lib.contexts[-3:]] == [256, 512, 1024]  # 1000, rounded up to 256s
    assert all(c.freed for c in lib.contexts[-3:-1]) and not lib.contexts[-1].freed
    r.reset(2, 1000)
    assert lib.contexts[-1].n_ctx == 2048  # two rows: the whole size at once
