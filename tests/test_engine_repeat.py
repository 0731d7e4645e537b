"""One engine, many calls: every call equals what a fresh engine gives for it.

A model with a 256-token context runs a sequence of calls of other lengths and batch
sizes up to the context's end (the last round's drafts then pass the context: their
positions need RoPE rows too) in AR, SD (draft model and n-gram) and SSD, each compared
with a fresh AR engine for that call (greedy: every mode must equal AR).
"""

from __future__ import annotations

import json
import shutil

import pytest

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

CONTEXT = 256
CALLS = [  # (prompts as token ids, max_new_tokens): first short, then up to the context end
    ([[5, 6, 7]], 8),
    ([[5] * 248], 8),
    ([[9] * 200], 56),
    ([[5, 6, 7, 8] * 10, [11, 12]], 40),
    ([[7] * 20], None),  # None: to the end of the context
    ([[5] * 248, [6] * 100], 8),
]


@pytest.fixture(scope="module")
def short(tiny_dir, tmp_path_factory):
    """The qwen2 target and its draft with a 256-token context."""
    root = tmp_path_factory.mktemp("short_context")
    out = {}
    for name in ("qwen2", "draft_qwen2"):
        dst = root / name
        shutil.copytree(tiny_dir[name], dst)
        config = json.loads((dst / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT
        (dst / "config.json").write_text(json.dumps(config))
        out[name] = str(dst)
    return out


def _tokens(engine: Engine, prompts, max_new, spec=None):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
    return [o.token_ids for o in done.outputs]


@pytest.fixture(scope="module")
def fresh_ar(short):
    """Each call on a new AR engine of its own."""
    out = []
    for prompts, max_new in CALLS:
        with Engine(EngineConfig(target=ModelSpec(short["qwen2"], dtype="float32"))) as engine:
            out.append(_tokens(engine, prompts, max_new))
    return out


@pytest.mark.parametrize(
    ("mode", "draft"), [(Mode.AR, None), (Mode.SD, "model"), (Mode.SD, "ngram"), (Mode.SSD, "model")]
)
@pytest.mark.parametrize("k", [2, 4])
def test_a_sequence_of_calls_on_one_engine_equals_fresh_engines(short, fresh_ar, mode, draft, k):
    if mode is Mode.AR and k == 4:
        pytest.skip("AR has no K")
    path = short["draft_qwen2"] if draft == "model" else draft
    config = EngineConfig(
        target=ModelSpec(short["qwen2"], dtype="float32"),
        spec=SpecConfig(mode=mode, k=k, draft=draft_of(path), backup="jit"),
        pin_cpus=False,
    )
    with Engine(config) as engine:
        limit = engine.context  # SSD's draft also holds the unverified proposal: K + 2 less
        for (prompts, max_new), want in zip(CALLS, fresh_ar):
            longest = max(map(len, prompts))
            if max_new is not None and longest + max_new > limit:
                with pytest.raises(UsageError, match="context"):
                    _tokens(engine, prompts, max_new)
                continue
            got = _tokens(engine, prompts, max_new)
            assert [w[: len(g)] for g, w in zip(got, want)] == got, (mode, draft, k, [len(p) for p in prompts])
            assert all(len(p) + len(g) == limit for p, g in zip(prompts, got)) if max_new is None else got == want
