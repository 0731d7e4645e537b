"""Host waits per round (core/hostsync.py): each mode within its budget, counted two ways.

On a GPU every device -> host read and every blocking host -> device copy synchronises the
stream. A round needs one read (what was accepted); under a grammar the matcher also needs
each draft on the host (K walks). Budgets, per round of a warm call, tiny fp32 models on CPU:
AR, SD (K=4) and adaptive SD <= 1.5 waits, greedy and sampled, grammar SD <= K + 2, SSD's
target <= 1.5 and its worker <= 2 whatever the batch (+1 when sampling: q's buffer is
synchronised before the proposal is sent). Each is checked with the product's own audit (`host_waits` in
the stats) and with a raw count of every read and blocking copy torch sees in this process
(so nothing bypasses the audit).
"""

from __future__ import annotations

import pytest
import torch

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.hostsync import Audit, HostWaits
from ssdlocal.engine import Engine
from support.drafts import draft_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

K = 4
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=24, ignore_eos=True, seed=5)
PROMPTS = ["The quick brown fox", "hello world, def foo(x):", "the cat"]
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu")


class RawWaits:
    """Every device -> host read and blocking host -> device copy torch makes while on."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.on = False
        for name in READS:
            self._wrap(monkeypatch, torch.Tensor, name, lambda *a, **k: True)
        self._wrap(monkeypatch, torch.Tensor, "to", self._blocking_to)
        self._wrap(monkeypatch, torch, "tensor", lambda *a, **k: k.get("device") is not None)

    @staticmethod
    def _blocking_to(self_, *args, **kw) -> bool:
        device = kw.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        return device is not None and not kw.get("non_blocking", False)

    def _wrap(self, monkeypatch, owner, name, counts) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kw):
            if self.on and counts(*args, **kw):
                self.count += 1
            return original(*args, **kw)

        monkeypatch.setattr(owner, name, wrapped)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    cfg = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=K, draft=draft_of(str(tiny_dir["draft_llama"]))),
        pin_cpus=False,
    )
    with Engine(cfg) as eng:
        yield eng


def generate(engine, spec, prompts=PROMPTS, grammars=None, params=PARAMS) -> DoneEvent:
    done = None
    for event in engine.generate(prompts, params, spec=spec, grammars=grammars):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def measured(engine, monkeypatch, spec, **kw) -> tuple[dict, float]:
    """(the call's host_waits stats, raw waits per round in this process) of a warm call."""
    generate(engine, spec, **kw)  # warm: loads the draft, spawns the worker
    raw = RawWaits(monkeypatch)
    raw.on = True
    done = generate(engine, spec, **kw)
    raw.on = False
    monkeypatch.undo()
    rounds = done.stats["rounds"]
    assert rounds > 0
    return done.stats["host_waits"], raw.count / rounds


def here(waits: dict) -> float:
    """Waits per round of the models in this process (target, and a draft run here)."""
    return sum(w["waits_per_round"] for m, w in waits.items() if m != "worker")


SPECS = {
    "ar": lambda d: SpecConfig(mode=Mode.AR),
    "sd": lambda d: SpecConfig(mode=Mode.SD, k=K, draft=draft_of(d, suffix=False)),
    "sd-suffix": lambda d: SpecConfig(mode=Mode.SD, k=K, draft=draft_of(d)),
    "adaptive": lambda d: SpecConfig(mode=Mode.SD, k=K, adaptive_k=True, draft=draft_of(d)),
}


@pytest.mark.parametrize("case", [*SPECS, "sd-sampled", "adaptive-sampled"])
def test_one_host_wait_per_round(engine, tiny_dir, monkeypatch, case):
    spec = SPECS[case.removesuffix("-sampled")](str(tiny_dir["draft_llama"]))
    waits, raw = measured(engine, monkeypatch, spec, params=SAMPLED if case.endswith("sampled") else PARAMS)
    assert waits["target"]["reads"] >= 1
    assert here(waits) <= 1.5, f"{case}: {waits}"
    assert raw <= 1.5, f"{case}: {raw:.2f} raw waits per round (the audit says {waits})"


def test_grammar_sd_waits_at_most_k_plus_two(engine, tiny_dir, monkeypatch):
    pytest.importorskip("llguidance")
    from ssdlocal.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer, engine.target.args.vocab_size, engine.eos_ids)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    grammars = [compiler.json_schema(schema), None, compiler.regex(r"[a-z]+( [a-z]+)*")]
    spec = SpecConfig(mode=Mode.SD, k=K, draft=draft_of(str(tiny_dir["draft_llama"]), suffix=False))
    waits, raw = measured(
        engine, monkeypatch, spec, grammars=grammars, params=SamplingParams(temperature=0.0, max_new_tokens=24)
    )
    assert here(waits) <= K + 2, waits
    assert raw <= K + 2, f"{raw:.2f} raw waits per round (the audit says {waits})"


@pytest.mark.parametrize("params", [PARAMS, SAMPLED], ids=["greedy", "sampled"])
def test_ssd_target_one_wait_and_worker_a_few_whatever_the_batch(engine, tiny_dir, monkeypatch, params):
    spec = SpecConfig(
        mode=Mode.SSD, k=K, draft=draft_of(str(tiny_dir["draft_llama"])), backup="jit", fan_out=(2, 2, 2, 2, 3)
    )
    waits, raw = measured(engine, monkeypatch, spec, params=params)
    assert waits["target"]["waits_per_round"] <= 1.5, waits
    assert raw <= 1.5, f"{raw:.2f} raw waits per round on the target (the audit says {waits})"
    # per round: the tree's bonuses and drafts (one read: the candidates of every row and
    # length stay on the device), a miss's just-in-time drafts (one), q's buffer when
    # sampling (one). Before: one more read (the candidates), B x (K+1) before that
    assert 0 < waits["worker"]["waits_per_round"] <= 2 + (not params.greedy), waits


def test_audit_counts_reads_once_and_staged_uploads_as_no_wait():
    audit = Audit()
    site = audit.site("target")
    a, b = torch.arange(3), torch.ones(2)
    assert site.read(a, b) == [[0, 1, 2], [1.0, 1.0]]
    up = site.upload([[1, 2], [3, 4]], "cpu")
    assert up.dtype == torch.long and up.tolist() == [[1, 2], [3, 4]]
    assert audit.snapshot() == {"target": HostWaits(reads=1, staged=1)}
    before = audit.snapshot()
    audit.site("draft").upload([True, False], torch.device("meta"), torch.bool)  # not CUDA: a blocking copy
    assert audit.since(before) == {"draft": HostWaits(blocking=1)}
    assert HostWaits(2, 1, 5).as_dict(rounds=2) == {
        "waits": 3,
        "reads": 2,
        "blocking": 1,
        "staged": 5,
        "waits_per_round": 1.5,
    }
    assert HostWaits(1).as_dict(rounds=0)["waits_per_round"] is None


def test_uploads_to_cuda_are_staged_and_non_blocking(monkeypatch):
    """The CUDA branch (on CUDA-shaped fakes): pinned when CUDA is there, non_blocking, no wait."""
    from support.fake_cuda import CUDA, fake_cuda

    seen = []
    original = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, *a, **k: seen.append(k.get("non_blocking")) or original(self, *a, **k)
    )
    audit = Audit()
    with fake_cuda():
        out = audit.site("target").upload([[1, 2], [3, 4]], CUDA)
    assert out.device.type == "cuda" and tuple(out.shape) == (2, 2)
    assert seen and all(seen)  # every copy on the way is non-blocking
    assert audit.snapshot() == {"target": HostWaits(staged=1)}
