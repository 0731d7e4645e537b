"""Captured forwards: the graph cache's bookkeeping (device abstracted), the captured code
path equal to the eager one token for token (fp32; AR, SD, SSD; one and several rows;
each architecture), float32 logits from bf16 weights, and real CUDA graphs (`gpu`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ssdlocal.backends.torch.capture import Captured, TracedGraphs
from ssdlocal.backends.torch.graphs import (
    BUCKETS,
    GraphCache,
    GraphSafetyError,
    bucket,
    graph_report,
    make_graph_cache,
)
from ssdlocal.backends.torch.logits import REFINED, fp32_logits, refine_top
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from support.drafts import draft_of
from ssdlocal.core.config import ModelDraft

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROMPTS = ["hello world, def foo(x):", "the cat", "Once upon a time there was a little model"]


# --------------------------------------------------------------------------- bookkeeping
class CountingBackend:
    """Capture = remember the function; replay = call it again over the static inputs.
    Counts captures and can refuse (memory), fail, or replay wrongly."""

    kind = "counting"

    def __init__(self, free=None, fail=False, wrong=False) -> None:
        self.free, self.fail, self.wrong = free, fail, wrong
        self.captures = 0

    def free_bytes(self):
        return self.free

    def capture(self, fn, inputs) -> Captured:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        static = {name: t.clone() for name, t in inputs.items()}
        output = fn(**static)

        def run() -> None:
            output.copy_(fn(**static) + (1.0 if self.wrong else 0.0))

        return Captured(static, output, run, output.nbytes, computed=True)


def _double(x):
    return x * 2


def test_capture_once_then_replay_with_new_inputs():
    backend = CountingBackend()
    cache = GraphCache(backend, self_check=False)
    first = cache.run(("step", 1, 2), _double, x=torch.tensor([1.0, 2.0]))
    assert first.tolist() == [2.0, 4.0] and backend.captures == 1
    again = cache.run(("step", 1, 2), _double, x=torch.tensor([5.0, 6.0]))
    assert again.tolist() == [10.0, 12.0] and backend.captures == 1
    assert again.data_ptr() == first.data_ptr()  # the static output buffer
    assert cache.stats.captured == 1 and cache.stats.replays == 1 and len(cache) == 1
    cache.run(("step", 1, 3), _double, x=torch.tensor([1.0, 1.0, 1.0]))
    assert backend.captures == 2 and len(cache) == 2
    cache.clear()
    assert len(cache) == 0
    cache.run(("step", 1, 2), _double, x=torch.tensor([1.0, 2.0]))
    assert backend.captures == 3


def test_a_mirror_hears_every_primitive_in_the_order_it_runs():
    """What the ranks of a tensor-parallel group repeat (parallel/group.py): a capture
    that computes (traced) or does not (CUDA: a replay follows), the self-check's eager
    run, a refused capture's eager run, and eager only after a failed self-check."""
    heard = []
    mirror = lambda action, key: heard.append((action, key))  # noqa: E731
    cache = GraphCache(CountingBackend())
    cache.run("a", _double, mirror=mirror, x=torch.ones(2))  # captured, computed
    cache.run("a", _double, mirror=mirror, x=torch.ones(2))  # first replay + self-check
    cache.run("a", _double, mirror=mirror, x=torch.ones(2))
    assert heard == [("capture", "a"), ("captured", "a"), ("replay", "a"), ("eager", "a"), ("replay", "a")]
    heard.clear()
    later = CountingBackend()
    uncomputed = later.capture
    later.capture = lambda fn, inputs: replace(uncomputed(fn, inputs), computed=False)  # as CUDA graphs
    cache = GraphCache(later, self_check=False)
    cache.run("b", _double, mirror=mirror, x=torch.ones(2))
    assert heard == [("capture", "b"), ("captured", "b"), ("replay", "b")]
    heard.clear()
    cache = GraphCache(CountingBackend(fail=True))
    cache.run("c", _double, mirror=mirror, x=torch.ones(2))
    assert heard == [("capture", "c"), ("captured", "c"), ("eager", "c")]
    heard.clear()
    refusing = lambda action, key: heard.append((action, key)) or _refuse_capture(action)  # noqa: E731
    cache = GraphCache(CountingBackend())  # captures here, but a mirrored rank could not
    assert cache.run("e", _double, mirror=refusing, x=torch.ones(2)).tolist() == [2.0, 2.0]
    assert heard == [("capture", "e"), ("captured", "e"), ("eager", "e")]  # eager on every rank
    assert len(cache) == 0 and cache.stats.refused == 1 and "rank 1" in cache.notes[0]
    heard.clear()
    cache = GraphCache(CountingBackend(wrong=True))
    for _ in range(3):
        cache.run("d", _double, mirror=mirror, x=torch.ones(2))
    assert heard == [("capture", "d"), ("captured", "d"), ("replay", "d"), ("eager", "d"), ("eager", "d")]


def _refuse_capture(action: str) -> None:
    from ssdlocal.backends.torch.capture import CaptureError

    if action == "captured":
        raise CaptureError("on rank 1: RuntimeError: operation not permitted when stream is capturing")


def test_memory_budget_refuses_capture_and_runs_eagerly():
    cache = GraphCache(CountingBackend(free=100), reserve_bytes=1000)
    out = cache.run("k", _double, x=torch.tensor([3.0]))
    assert out.tolist() == [6.0]
    assert len(cache) == 0 and cache.stats.eager == 1 and cache.stats.refused == 1
    assert "memory budget" in cache.notes[0]
    cache.run("k", _double, x=torch.tensor([4.0]))
    assert cache.stats.eager == 2 and cache.stats.refused == 1  # not tried again


def test_failed_capture_falls_back_to_eager_for_that_shape():
    cache = GraphCache(CountingBackend(fail=True))
    assert cache.run("k", _double, x=torch.tensor([1.0])).tolist() == [2.0]
    assert len(cache) == 0 and "capture failed" in cache.notes[0] and cache.stats.refused == 1


def test_graph_count_limit_lets_the_least_recently_used_go():
    """Past max_graphs a new shape is captured all the same: the graph replayed longest ago
    goes (and a mirror is told), never the new shape (it used to be refused: eager for good)."""
    backend = CountingBackend()
    cache = GraphCache(backend, max_graphs=2)
    evicted = []
    cache.on_forget = evicted.append
    for key in (0, 1, 0, 2, 3, 0):  # 0 is replayed before 2 arrives: 1 goes first, then 0, then 2
        assert cache.run(key, _double, x=torch.tensor([float(key)])).tolist() == [2.0 * key]
    assert evicted == [1, 0, 2] and len(cache) == 2 and cache.stats.evicted == 3
    assert cache.stats.eager == 0 and cache.stats.refused == 0 and backend.captures == 5


def test_buckets_and_modes(monkeypatch):
    assert [bucket(w) for w in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, 65]
    assert BUCKETS[0] == 1
    cpu = torch.device("cpu")
    monkeypatch.delenv("SSDLOCAL_GRAPHS", raising=False)
    assert make_graph_cache(cpu, "auto") is None and make_graph_cache(cpu, "off") is None
    assert isinstance(make_graph_cache(cpu, "trace").backend, TracedGraphs)
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "trace")  # the environment wins over the config
    assert isinstance(make_graph_cache(cpu, "auto").backend, TracedGraphs)
    assert isinstance(make_graph_cache(cpu, "off").backend, TracedGraphs)
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "off")
    assert make_graph_cache(cpu, "trace") is None
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "emulate")
    with pytest.raises(UsageError, match="SSDLOCAL_GRAPHS"):
        make_graph_cache(cpu, "auto")


def test_a_wrong_first_replay_drops_the_graphs_and_runs_eagerly():
    """The self-check: the first replay of each shape is compared with an eager run."""
    cache = GraphCache(CountingBackend(wrong=True))
    assert cache.run("k", _double, x=torch.tensor([1.0])).tolist() == [2.0]  # the capturing call
    assert cache.run("k", _double, x=torch.tensor([2.0])).tolist() == [4.0]  # replay 5 != eager 4
    assert cache.disabled and cache.stats.dropped == 1 and "differs from eager" in cache.notes[0]
    assert cache.run("k", _double, x=torch.tensor([3.0])).tolist() == [6.0]  # eager from now on
    assert cache.stats.eager == 1 and len(cache) == 0


class Owner:
    """A graph owner with one declared static tensor (`scale`), like a runner's state."""

    def __init__(self) -> None:
        self.scale = torch.tensor([2.0])
        self.hidden = torch.tensor([10.0])  # read by `leaky`, never registered

    def registered(self):
        yield self.scale

    def state_tensors(self):
        return (self.scale,)

    def describe(self, tensor):
        for name, value in vars(self).items():
            if value is tensor:
                return f"owner.{name}"
        return "unknown"

    def step(self, x):
        return x * self.scale

    def leaky(self, x):
        return x + self.hidden


def test_traced_replay_reads_a_rebound_tensor_stale_like_a_cuda_graph():
    """No Python runs at replay: the tensor held at capture is read, as a CUDA graph would."""
    owner = Owner()
    cache = GraphCache(TracedGraphs(), None, self_check=False)  # no owner declaration: no guards
    assert cache.run("k", owner.step, x=torch.tensor([1.0])).tolist() == [2.0]
    owner.scale = torch.tensor([3.0])  # rebound, not updated in place
    assert cache.run("k", owner.step, x=torch.tensor([1.0])).tolist() == [2.0]  # stale
    owner.scale.fill_(5.0)  # the new tensor: invisible to the graph
    assert cache.run("k", owner.step, x=torch.tensor([1.0])).tolist() == [2.0]


def test_the_traced_twin_catches_an_output_held_across_another_call():
    """The graph-pool rule (capture.py): a step's output is valid until the next capture or
    replay of its cache, whatever the shape. The traced twin fills the last output with NaN
    before the next call, so a caller that holds one reads garbage on the CPU too."""
    cache = GraphCache(TracedGraphs())
    double = lambda x: x * 2  # noqa: E731
    a = cache.run("a", double, x=torch.ones(2))  # captured (the capture computed it)
    kept = a.clone()
    b = cache.run("b", double, x=torch.ones(3))  # another shape
    assert torch.isnan(a).all() and torch.equal(kept, torch.full((2,), 2.0))
    again = cache.run("a", double, x=torch.full((2,), 3.0))  # a replay writes its buffer again
    assert again is a and torch.equal(a, torch.full((2,), 6.0)) and torch.isnan(b).all()
    cache.run("a", double, x=torch.ones(2))  # the same shape: the held values are gone too
    assert torch.equal(again, torch.full((2,), 2.0))


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_a_step_at_a_column_runs_the_lm_head_on_that_column_only(tiny_dir, graphs):
    """A draft's catch-up (`step(at=)`) needs each row's newest token's logits: only those
    reach the lm_head, equal to the full step's at that column (eager, and replayed from a
    traced capture of its own with new columns)."""
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.runner import TorchRunner

    loaded = registry.load(ModelSpec(str(tiny_dir["qwen2"]), dtype="float32"))
    runner = TorchRunner(loaded, graphs=graphs)
    runner.reset(2, 64)
    runner.feed([[5, 6, 7], [8, 9]], "none")
    runner.begin_steps()
    ids = torch.tensor([[10, 11, 12], [13, 0, 0]])
    full = runner.step(ids).clone()  # [B, T, V]
    seen: list[tuple[int, ...]] = []
    hook = loaded.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    for at in ([2, 0], [1, 0], [0, 0]):  # the second and third replay the first's capture
        got = runner.step(ids, at=torch.tensor(at))
        assert got.shape == (2, loaded.args.vocab_size)
        for b in range(2):
            assert torch.allclose(got[b], full[b, at[b]], atol=1e-5), (at, b)
    hook.remove()
    assert seen and all(shape[:2] == (2, 1) for shape in seen)  # never [2, 3, hidden]


def test_the_runner_keeps_the_graph_pool_rule(tiny_dir):
    """A decode step's logits are the graph's buffer (the caller reads them before the next
    step); a tree step's are the caller's (forward_raw clones them)."""
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.runner import TorchRunner
    from ssdlocal.backends.torch.models import causal_mask

    runner = TorchRunner(registry.load(ModelSpec(str(tiny_dir["llama"]), dtype="float32")), graphs="trace")
    runner.reset(1, 64)
    runner.feed([[5, 6, 7, 8]], "none")
    runner.begin_steps()
    step = runner.step(torch.tensor([[9]]))  # [1, 1, V], captured
    positions = torch.tensor([[4, 5]])
    tree = runner.forward_raw(torch.tensor([[9, 10]]), positions, positions, causal_mask(positions, 64))
    assert torch.isnan(step).all()  # held across the tree step: caught
    runner.step(torch.tensor([[9, 10, 11]]))  # another shape
    assert not torch.isnan(tree).any()  # forward_raw handed out its own copy


def test_the_guard_catches_a_rebound_static_tensor():
    owner = Owner()
    strict = GraphCache(TracedGraphs(), owner, strict=True)
    strict.run("k", owner.step, x=torch.tensor([1.0]))
    owner.scale = torch.tensor([3.0])
    with pytest.raises(GraphSafetyError, match="owner.scale"):
        strict.run("k", owner.step, x=torch.tensor([1.0]))
    owner = Owner()
    lenient = GraphCache(TracedGraphs(), owner, strict=False)
    lenient.run("k", owner.step, x=torch.tensor([1.0]))
    owner.scale = torch.tensor([3.0])
    assert lenient.run("k", owner.step, x=torch.tensor([1.0])).tolist() == [3.0]  # recaptured
    assert lenient.stats.dropped == 1 and lenient.stats.captured == 2


def test_the_audit_lists_tensors_that_are_not_registered_static():
    owner = Owner()
    strict = GraphCache(TracedGraphs(), owner, strict=True)
    with pytest.raises(GraphSafetyError, match="owner.hidden"):
        strict.run("k", owner.leaky, x=torch.tensor([1.0]))
    lenient = GraphCache(TracedGraphs(), owner, strict=False)
    assert lenient.run("k", owner.leaky, x=torch.tensor([1.0])).tolist() == [11.0]
    assert lenient.stats.refused == 1 and lenient.stats.eager == 1 and "owner.hidden" in lenient.notes[0]
    owner.hidden = torch.tensor([20.0])
    assert lenient.run("k", owner.leaky, x=torch.tensor([1.0])).tolist() == [21.0]  # eager: fresh


def test_graph_report_counts_one_calls_share():
    cache = GraphCache(CountingBackend(free=100), reserve_bytes=1000)

    class Runner:
        graphs = cache

    before = graph_report(Runner())
    cache.run("k", _double, x=torch.tensor([1.0]))
    report = graph_report(Runner(), before)
    assert report["mode"] == "counting" and report["refused"] == 1 and report["eager"] == 1
    assert "memory budget" in report["notes"][0]
    assert graph_report(object()) == {
        "mode": "off",
        "captured": 0,
        "replays": 0,
        "eager": 0,
        "refused": 0,
        "dropped": 0,
        "evicted": 0,
    }


# --------------------------------------------------------------------------- fp32 logits
def test_refined_logits_match_float32_where_it_matters():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=True).to(torch.bfloat16)
    h = torch.randn(2, 3, 64).to(torch.bfloat16)
    exact = h.float() @ head.weight.float().t() + head.bias.float()  # [2, 3, 500]
    rounded = head(h).float()
    got = fp32_logits(head, h)
    top = exact.topk(REFINED, dim=-1)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert torch.allclose(got.gather(-1, top.indices), top.values, atol=1e-4)
    assert not torch.equal(rounded, exact)  # bf16 output rounding is what the refinement removes
    # a near tie in bf16 output is decided by the float32 values
    tie = torch.zeros(1, 1, 500)
    tie[0, 0, 7] = tie[0, 0, 9] = 1.0
    w = torch.zeros(500, 4)
    w[7, 0], w[9, 0] = 1.0, 1.001
    refined = refine_top(tie.clone(), torch.ones(1, 1, 4), lambda top: w[top], None)
    assert int(refined.argmax()) == 9


# --------------------------------------------------------------------------- engine paths
def _tokens(engine: Engine, spec: SpecConfig, prompts) -> list[tuple[int, ...]]:
    done = [e for e in engine.generate(prompts, GREEDY, spec=spec) if isinstance(e, DoneEvent)]
    return [o.token_ids for o in done[0].outputs]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.mark.parametrize(("target", "draft"), [("llama", "draft_llama"), ("qwen2", "draft_qwen2"), ("qwen3", "qwen3")])
def test_captured_path_equals_eager_path(tiny_dir, target, draft):
    """The path a CUDA graph replays (traced op graphs over static buffers, full-cache
    masks, padded tree widths) gives the eager path's tokens in AR, SD and SSD, for one row
    and for three."""
    t, d = str(tiny_dir[target]), str(tiny_dir[draft])

    def engine(graphs: str) -> Engine:
        return Engine(
            EngineConfig(
                target=ModelSpec(t, dtype="float32"),
                spec=SpecConfig(mode=Mode.SSD, k=3, draft=ModelDraft(ModelSpec(d, dtype="float32")), backup="jit"),
                pin_cpus=False,
                graphs=graphs,
            )
        )

    specs = [SpecConfig(mode=m, k=3, draft=draft_of(d), backup="jit") for m in (Mode.AR, Mode.SD, Mode.SSD)]
    with engine("off") as eager:
        want = {(s.mode, n): _tokens(eager, s, PROMPTS[:n]) for s in specs for n in (1, 3)}
    with engine("trace") as captured:
        for (mode, n), tokens in want.items():
            spec = next(s for s in specs if s.mode is mode)
            assert _tokens(captured, spec, PROMPTS[:n]) == tokens, (mode, n)
        graphs = captured.runner.graphs
        assert graphs is not None and graphs.stats.replays > 0 and graphs.stats.captured >= 4
        assert want[(Mode.AR, 3)] == want[(Mode.SSD, 3)] == want[(Mode.SD, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_gpu(tiny_dir):
    t, d = str(tiny_dir["llama"]), str(tiny_dir["draft_llama"])
    results = {}
    for graphs in ("off", "auto"):
        config = EngineConfig(
            target=ModelSpec(t, "cuda:0", dtype="float32"),
            spec=SpecConfig(mode=Mode.SD, k=3, draft=ModelDraft(ModelSpec(d, "cuda:0", dtype="float32"))),
            graphs=graphs,
        )
        with Engine(config) as engine:
            results[graphs] = [
                _tokens(engine, SpecConfig(mode=m, k=3, draft=draft_of(d)), PROMPTS) for m in (Mode.AR, Mode.SD)
            ]
            if graphs == "auto":
                assert engine.runner.graphs.stats.captured > 0
    assert results["off"] == results["auto"]


def test_gpu_bench_script_runs_on_cpu(tmp_path):
    """`scripts/gpu_bench.py --cpu --quick` exercises the GPU benchmark's code without a GPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.py"
    subprocess.run(
        [sys.executable, str(script), "--cpu", "--quick", "--out", str(tmp_path)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert [m["model"] for m in results["models"]] == ["tiny-draft", "tiny-target"]
    assert results["models"][0]["tree16_graphs_ms"] > 0 and results["models"][1]["ar_tok_s"] > 0
    assert set(results["end_to_end"]["modes"]) == {"ar", "sd", "ssd"}
    assert "| tiny-target |" in (tmp_path / "results.md").read_text()


def test_kv_cache_grows_keeping_its_contents(tiny_dir, monkeypatch):
    """The cache starts small and doubles as rows grow; what it held survives, and the
    logits equal those of a cache allocated at full size up front."""
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch import runner as runner_mod

    loaded = registry.load(ModelSpec(str(tiny_dir["llama"]), dtype="float32"))
    prompt = [5 + (i * 7) % 300 for i in range(300)]

    def logits(first_capacity: int, graphs: str):
        monkeypatch.setattr(runner_mod, "FIRST_CAPACITY", first_capacity)
        runner = runner_mod.TorchRunner(loaded, graphs=graphs)
        runner.reset(1, 500)
        start = runner.capacity
        out = [runner.feed([prompt[:100]])[0], runner.feed([prompt[100:]])[0]]
        runner.begin_steps()
        out.append(runner.step(torch.tensor([[7, 8]]), bound=302).clone()[0])
        return torch.cat(out), start, runner.capacity

    grown, start, end = logits(256, "off")
    assert start == 256 and end == 512
    full, start, _ = logits(1024, "off")
    assert start == 512  # never more than the call may use
    assert torch.equal(grown, full)
    traced, _, _ = logits(256, "trace")  # captured steps attend over a bucketed span
    assert torch.allclose(traced, full, atol=1e-5)


def test_the_lm_head_runs_only_on_the_positions_asked_for(tiny_dir):
    """A prefill needs the last position's logits only: a long prompt must not build
    [T, V] float32 logits (32k tokens x 152k vocabulary = 20 GB)."""
    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.runner import TorchRunner

    loaded = registry.load(ModelSpec(str(tiny_dir["qwen2"]), dtype="float32"))
    seen: list[tuple[int, ...]] = []
    loaded.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    prompts = [[5 + i % 50 for i in range(300)], [7, 8, 9]]
    runner = TorchRunner(loaded, graphs="off")
    runner.reset(2, 400)
    every = runner.feed(prompts, "all")
    runner.reset(2, 400)
    last = runner.feed(prompts, "last")
    runner.reset(2, 400)
    none = runner.feed(prompts, "none")
    assert seen == [(2, 300, 64), (2, 1, 64), (2, 0, 64)]
    assert [t.shape for t in last] == [(1, loaded.args.vocab_size)] * 2 and [t.shape[0] for t in none] == [0, 0]
    for b in range(2):
        assert torch.allclose(last[b][0], every[b][-1], atol=1e-5)
    with pytest.raises(ValueError, match="logits"):
        runner.feed(prompts, "first")


def test_the_cli_says_in_one_line_when_graphs_were_refused_or_dropped():
    from ssdlocal.cli.render import graph_warning
    from ssdlocal.core.metrics import Metrics

    quiet = Metrics(
        graphs={"target": {"mode": "cuda", "captured": 3, "replays": 90, "eager": 0, "refused": 0, "dropped": 0}}
    )
    assert graph_warning(quiet) is None and graph_warning(Metrics()) is None
    loud = Metrics(
        graphs={
            "target": {
                "mode": "cuda",
                "refused": 2,
                "dropped": 0,
                "notes": ["shape ('step', 1, 5, 512): memory budget"],
            },
            "draft": {"mode": "cuda", "refused": 0, "dropped": 1, "notes": ["replay differs from eager"]},
        }
    )
    line = graph_warning(loud)
    assert "\n" not in line and "target 2 shape(s) refused" in line and "memory budget" in line
    assert "draft dropped 1 time(s)" in line and "same output" in line


@pytest.mark.parametrize("graphs", ["off", "trace"])
def test_a_runner_let_go_is_freed_without_a_garbage_collection(tiny_dir, graphs):
    """Nothing the runner owns (its graph cache, its staging row) refers back to it, so the
    last reference going frees it, and with it its graphs' memory and its state, at once:
    a reference cycle kept a GPU's memory until the next collection. (A traced graph's own
    fx structures still form cycles among themselves, on the CPU twin only.)"""
    import gc
    import weakref

    from ssdlocal.backends import registry
    from ssdlocal.backends.torch.runner import TorchRunner

    loaded = registry.load(ModelSpec(str(tiny_dir["llama"]), dtype="float32"))
    gc.collect()
    gc.disable()
    try:
        runner = TorchRunner(loaded, graphs=graphs)
        runner.reset(2, 300)
        runner.feed([[1, 2, 3], [4, 5]], "last")
        runner.begin_steps()
        for _ in range(3):
            runner.step(torch.zeros(2, 1, dtype=torch.long), 10)
            runner.advance(1)
        gone, state = weakref.ref(runner), weakref.ref(runner.state.lengths)
        del runner
        assert gone() is None
        assert state() is None or graphs == "trace"
    finally:
        gc.enable()


def test_a_tensor_parallel_model_let_go_is_freed_without_a_garbage_collection(tiny_dir):
    """The same for rank 0's TPModel: its graph cache and the cache's on_forget (which tells
    the ranks to drop a graph) refer to the group, not back to the model."""
    import gc
    import weakref

    from ssdlocal.backends import registry
    from ssdlocal.parallel.tpmodel import TPModel

    class Group:  # what TPModel.use_graphs asks of a RankGroup, with no rank processes
        device = torch.device("cpu")
        told: list = []

        def command_all(self, cmd, arg=None) -> None:
            self.told.append((cmd, arg))

        def collect_acks(self) -> None:
            pass

    shard = registry.load(ModelSpec(str(tiny_dir["llama"]), dtype="float32")).model
    group = Group()
    gc.collect()
    gc.disable()
    try:
        model = TPModel(shard, group)
        assert model.use_graphs("trace") is not None
        model.graphs.on_forget("a key")  # still reaches the ranks through the group
        assert group.told[-1][1] == "a key"
        gone = weakref.ref(model)
        del model
        assert gone() is None
    finally:
        gc.enable()
