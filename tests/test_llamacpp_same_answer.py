"""The same answer every time on llama.cpp's CPU kernels (marker `llamacpp`): at
temperature 0 one request's tokens and log-probabilities are the same bit for bit whatever
came before it (nothing, a request sharing most of its prompt, unrelated ones, itself),
with the prefix store on, as `serve` runs it.

llama.cpp gives a token logits that depend on where its row's cells sit and on the width of
the call that read it (docs/architecture.md §2): a row alone keeps cells 0, 1, ... for its
positions (the store keeps saved states outside the context) and reuses only whole chunks
of a cold read (backends/llamacpp/prefix.py). Each warm history must really reuse a chunk,
so the test cannot pass by reading everything cold. A tiny Q4_K_M-like GGUF runs on the same
quantized kernels as the real models (its logits move with cell placement and call width,
which a bitwise comparison sees); the real Qwen2.5-Coder 0.5B Q4_K_M runs too when it is in
the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.llamacpp
pytest.importorskip("llama_cpp")

from ssdlocal.backends.llamacpp.runner import N_BATCH
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent, TokensEvent
from ssdlocal.engine import Engine
from ssdlocal.weights.assets import DEFAULT_DRAFT, gguf_path

REAL = gguf_path(DEFAULT_DRAFT)


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSDLOCAL_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny Q4_K_M-like Qwen2 (llama.cpp's quantized CPU kernels, as the real models')."""
    from support.tiny_gguf import make_hf_model, write_gguf

    model = make_hf_model("qwen2", seed=3)
    model.config.max_position_embeddings = 2048
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2-q4km-2k.gguf", model, "qwen2", "q4_k_m")


def answer(engine: Engine, ids: list[int], new: int) -> tuple[list[int], list[float], int]:
    """(tokens, their log-probabilities, prompt tokens taken from the prefix store)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True, logprobs=1)
    tokens, logprobs, cached = [], [], 0
    for event in engine.generate([ids], params):
        if isinstance(event, TokensEvent):
            tokens += list(event.token_ids)
            logprobs += [lp.logprob for lp in event.logprobs or ()]
        elif isinstance(event, DoneEvent):
            cached = event.stats["cached_prompt_tokens"]
    return tokens, logprobs, cached


def same_after_any_history(path: str, vocab: int, new: int) -> None:
    def ids(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + 31 * i + (i * i) % 13) % (vocab - 20) + 10 for i in range(n)]

    request = ids(1, N_BATCH + 150)
    sharing = request[: N_BATCH + 60] + ids(2, 90)  # shares the first chunk and more
    other = ids(3, 300)
    histories = {"cold": [], "after one sharing its prompt": [sharing], "after others": [other, sharing]}
    histories["after itself"] = [request]
    histories["after itself twice, the other between"] = [request, other, request]
    got = {}
    for name, before in histories.items():
        config = EngineConfig(ModelSpec(path, backend="llamacpp"), SpecConfig(mode=Mode.AR), pin_cpus=False)
        with Engine(config) as engine:
            for earlier in before:
                answer(engine, earlier, new)
            tokens, logprobs, cached = answer(engine, request, new)
        assert cached == (0 if not before else N_BATCH), name  # warm histories reuse a whole chunk
        got[name] = (tokens, logprobs)
    cold = got["cold"]
    for name, result in got.items():
        assert result[0] == cold[0], f"{name}: other tokens than a cold read"
        assert result[1] == cold[1], f"{name}: other log-probabilities than a cold read"


def test_one_request_answers_the_same_after_any_history(tiny_gguf):
    same_after_any_history(str(tiny_gguf), vocab=256, new=24)


@pytest.mark.timeout(1800)  # 5 histories of a 662-token prompt: minutes on a busy 2-core machine
@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not assembled (ssdlocal pull)")
def test_the_real_05b_answers_the_same_after_any_history():
    same_after_any_history(str(REAL), vocab=151_000, new=16)
