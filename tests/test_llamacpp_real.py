"""The llama.cpp backend with the compiled llama-cpp-python (marker `llamacpp`, deselected
by default: `pytest -m llamacpp`). Greedy exactness: our SD and SSD with a llama.cpp
target reproduce our AR with the same target token for token, on a tiny F32 GGUF the
suite writes and on the real Qwen2.5-Coder 0.5B Q4_K_M when it is in the cache. When a
quantized run diverges, the failure names the target's logit margin there (docs/architecture.md §2:
batch shapes change llama.cpp's numerics, so a near-tie can flip).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.llamacpp
pytest.importorskip("llama_cpp")

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from ssdlocal.weights.assets import DEFAULT_DRAFT, gguf_path
from ssdlocal.core.config import ModelDraft, NgramDraft

PROMPTS = ["the cat sat on the mat and the cat", "def f(x): return x + 1\ndef g"]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from support.tiny_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2-f32.gguf"
    write_tiny_gguf(path)
    return path


def run(engine, prompts, spec, params, chat=False):
    done = [e for e in engine.generate(prompts, params, spec=spec, chat=chat) if isinstance(e, DoneEvent)]
    return [list(o.token_ids) for o in done[0].outputs], done[0].stats


def margin_note(engine, prompt_ids, ref, got) -> str:
    """Where `got` leaves `ref`, and the target's top-2 logit gap at that position."""
    import torch

    for p, (a, b) in enumerate(zip(ref, got)):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        engine.runner.reset(1, len(prompt_ids[p]) + i + 2)
        logits = engine.runner.feed([prompt_ids[p] + a[:i]])[0][-1]
        top = torch.topk(logits, 2).values
        return f"prompt {p} token {i}: AR {a[i]} vs {b[i]}, target top-2 margin {float(top[0] - top[1]):.4g}"
    return "same tokens"


def check_all_modes(target: str, draft: str, chat: bool, max_new: int, prompts=PROMPTS, alike=False):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    cfg = EngineConfig(
        target=ModelSpec(target, backend="llamacpp", dtype="float32", batch_invariant=alike),
        spec=SpecConfig(mode=Mode.SSD, k=3, draft=ModelDraft(ModelSpec(draft, backend="llamacpp", dtype="float32"))),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        ids = [eng.encode(p, chat) for p in prompts]
        ar, _ = run(eng, ids, SpecConfig(mode=Mode.AR), params)
        specs = {
            "sd-ngram": SpecConfig(mode=Mode.SD, k=4, draft=NgramDraft()),
            "sd": SpecConfig(mode=Mode.SD, k=3, draft=cfg.spec.draft),
            "ssd": SpecConfig(
                mode=Mode.SSD, k=3, draft=cfg.spec.draft, fan_out=(2, 2, 1, 3), fan_out_miss=(2, 2, 1, 3)
            ),
            "ssd-auto": SpecConfig(mode=Mode.SSD, k=3, draft=cfg.spec.draft),
        }
        stats = {}
        for name, spec in specs.items():
            for batch in (ids, ids[:1]):
                out, st = run(eng, batch, spec, params)
                assert out == ar[: len(batch)], f"{name}: " + margin_note(eng, batch, ar, out)
            stats[name] = st
    return stats


def test_tiny_gguf_ar_sd_ssd_exact(tiny_gguf):
    stats = check_all_modes(str(tiny_gguf), str(tiny_gguf), chat=False, max_new=24)
    assert stats["sd"]["acceptance_rate"] > 0.9  # itself as draft
    assert stats["ssd"]["cache_hit_rate"] > 0.5


REAL = gguf_path(DEFAULT_DRAFT)


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not assembled (ssdlocal pull)")
def test_real_qwen_05b_ar_sd_ssd_exact():
    prompts = ["Write a Python function that checks whether a number is prime."]
    check_all_modes(str(REAL), str(REAL), chat=True, max_new=32, prompts=prompts)


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not assembled (ssdlocal pull)")
def test_real_qwen_05b_batch_invariant_exact_and_steps_bit_for_bit():
    """With --batch-invariant a token's logits are the same bit for bit whether it is fed
    alone (AR) or in a verification of four (SD), on this machine's llama.cpp kernels."""
    import torch

    from ssdlocal.backends.base import Logits
    from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf

    prompts = ["Write a Python function that checks whether a number is prime."]
    check_all_modes(str(REAL), str(REAL), chat=True, max_new=32, prompts=prompts, alike=True)
    runner = LlamaCppRunner(load_gguf(REAL, batch_invariant=True))
    runner.reset(1, 128)
    prompt = runner.loaded.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")
    runner.feed([prompt], Logits.LAST)
    tokens = [13, 262, 470, 15801, 1445, 481, 16, 8]
    alone = torch.cat([runner.feed([[t]])[0] for t in tokens])
    del runner.held[0][len(prompt) :]
    fours = torch.cat([runner.feed([tokens[:4]])[0], runner.feed([tokens[4:]])[0]])
    assert runner.alike_width >= 2
    assert torch.equal(alone, fours)


def test_torch_target_with_gguf_draft(tiny_gguf):
    """Mixed backends: the torch target (the GGUF converted) verifies a llama.cpp draft."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    cfg = EngineConfig(
        target=ModelSpec(str(tiny_gguf), dtype="float32"),
        spec=SpecConfig(
            mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(str(tiny_gguf), backend="llamacpp", dtype="float32"))
        ),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        ar, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.AR), params)
        sd, st = run(eng, PROMPTS, None, params)
        ssd, _ = run(eng, PROMPTS, SpecConfig(mode=Mode.SSD, k=3, draft=cfg.spec.draft), params)
    assert sd == ar and ssd == ar
    assert st["acceptance_rate"] > 0.8


def test_llama_cpp_rejects_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\0" * 100)
    with pytest.raises(ModelLoadError):
        Engine(EngineConfig(target=ModelSpec(str(bad), backend="llamacpp", dtype="float32")))


def test_probe_verdict_with_the_real_library(tmp_path, record_property):
    """The probe's own tiny model (written without the network) loads and evaluates in the
    real llama.cpp; on a healthy machine the verdict trusts it with repacking on, and on
    one where repacking crashes it must still be usable with repacking off."""
    from ssdlocal.backends.llamacpp import probe, probe_child
    from ssdlocal.backends.llamacpp.lib import LlamaLib
    from ssdlocal.backends.llamacpp.probe_model import write_probe_gguf

    found = probe.llamacpp_verdict()  # child processes: a crash cannot take pytest with it
    record_property("llamacpp_probe", found.reason)
    assert found.ok, found.reason
    path = str(write_probe_gguf(tmp_path / "probe.gguf"))
    assert len(probe_child.evaluate(LlamaLib(extra_bufts=found.extra_bufts), path, 2)) == 3
    assert len(probe_child.evaluate(LlamaLib(extra_bufts=False), path, 2)) == 3


@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not assembled (ssdlocal pull)")
def test_real_qwen_05b_a_grown_context_gives_the_same_logits_bit_for_bit(monkeypatch):
    """A lone row's context that grows (its cells moved into a larger context through
    llama.cpp's sequence state, twice here) gives every step the logits of a context that
    had the full size from the start."""
    import torch

    from ssdlocal.backends.base import Logits
    from ssdlocal.backends.llamacpp import LlamaCppRunner, load_gguf
    from ssdlocal.backends.llamacpp import runner as runner_module

    loaded = load_gguf(REAL)
    prompt = loaded.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n" * 6)

    def steps(grow_from: int) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(runner_module, "GROW_FROM", grow_from)
        runner = LlamaCppRunner(loaded)
        runner.reset(1, 2048)
        rows = [runner.feed([prompt], Logits.LAST)[0][-1]]
        while len(prompt) + len(rows) < 600:
            rows.append(runner.feed([[int(torch.argmax(rows[-1]))]])[0][-1])
        cells = runner._ctx_cells
        runner.close()
        return torch.stack(rows), cells

    grown, cells = steps(256)
    full, full_cells = steps(1 << 20)
    assert (cells, full_cells) == (1024, 2048)  # 256 -> 512 -> 1024 against 2048 from the start
    assert torch.equal(grown, full)
