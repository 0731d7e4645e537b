"""How CUDA graphs are captured, checked against a recording stand-in for `torch.cuda`.

No GPU needed: every `torch.cuda` call `CudaGraphs` makes is recorded, so the test sees
on which device and stream the warm-up and the recording run, that a failed capture puts
the caller's stream back, that an empty graph (recorded on another device or stream) is a
failed capture rather than a graph that replays nothing, and that replays run inside the
graph's device. What the recording cannot show (that the kernels really land in the
graph) is checked by the `gpu` tests and scripts/gpu_accept.py.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from ssdlocal.backends import registry
from ssdlocal.backends.torch import capture
from ssdlocal.backends.torch.capture import CaptureError, CudaGraphs


class _Stream:
    def __init__(self, name: str, device) -> None:
        self.name, self.device = name, torch.device(device)

    def wait_stream(self, other: _Stream) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class FakeCuda:
    """Records (call, current device, current stream, detail) for every call made."""

    def __init__(self, *, fail: bool = False, empty: bool = False) -> None:
        self.calls: list[tuple] = []
        self.device_now: torch.device | None = None
        self.default = {}
        self.stream_now: _Stream | None = None
        self.fail, self.empty = fail, empty

    def _log(self, what: str, detail=None) -> None:
        self.calls.append((what, self.device_now, self.stream_now, detail))

    @contextlib.contextmanager
    def device(self, dev):
        before, before_stream = self.device_now, self.stream_now
        self.device_now = torch.device(dev)
        self.stream_now = self.default.setdefault(self.device_now, _Stream(f"default:{dev}", dev))
        try:
            yield
        finally:
            self.device_now, self.stream_now = before, before_stream

    def Stream(self, dev):  # noqa: N802 - torch's name
        self._log("Stream", str(dev))
        return _Stream(f"side:{dev}", dev)

    def graph_pool_handle(self):
        return "pool"

    def memory_reserved(self, dev):
        return 0

    def current_stream(self, dev):
        return self.stream_now

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        before, self.stream_now = self.stream_now, s
        try:
            yield
        finally:
            self.stream_now = before

    def set_stream(self, s: _Stream) -> None:
        self._log("set_stream", s)
        self.stream_now = s

    def CUDAGraph(self):  # noqa: N802 - torch's name
        recorder = self

        class Graph:
            def replay(self) -> None:
                recorder._log("replay")

        return Graph()

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):
        self._log("graph", (stream, capture_error_mode))
        self.stream_now = stream  # capture_begin makes the capture stream current
        if self.empty:
            warnings.warn(
                "The CUDA Graph is empty. This usually means that the graph was attempted "
                "to be captured on wrong device or stream."
            )
        yield
        if self.fail:  # capture_end raising leaves the capture stream current
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


@pytest.fixture
def fake(monkeypatch):
    def install(**kwargs) -> FakeCuda:
        rec = FakeCuda(**kwargs)
        for name in (
            "device",
            "Stream",
            "graph_pool_handle",
            "memory_reserved",
            "current_stream",
            "stream",
            "set_stream",
            "CUDAGraph",
            "graph",
        ):
            monkeypatch.setattr(capture.torch.cuda, name, getattr(rec, name))
        return rec

    return install


def _step(rec: FakeCuda):
    def fn(x):
        rec._log("step")
        return x + 1

    return fn


def test_warm_up_and_recording_run_on_one_side_stream_of_the_models_device(fake):
    rec = fake()
    graphs = CudaGraphs(torch.device("cuda:1"))
    graphs.capture(_step(rec), {"x": torch.zeros(2)})
    cuda1 = torch.device("cuda:1")
    assert rec.calls[0] == ("Stream", cuda1, rec.default[cuda1], "cuda:1")  # made inside cuda:1
    steps = [c for c in rec.calls if c[0] == "step"]
    assert len(steps) == 3  # two warm-ups, one recorded
    assert {(c[1], c[2].name) for c in steps} == {(cuda1, "side:cuda:1")}
    (graph_call,) = [c for c in rec.calls if c[0] == "graph"]
    assert graph_call[1] == cuda1 and graph_call[3][0].name == "side:cuda:1"
    assert graph_call[3][1] == "thread_local"  # another thread's CUDA work does not break it
    assert rec.calls[-1][0] == "set_stream" and rec.calls[-1][3].name == "default:cuda:1"


def test_one_side_stream_per_device_for_every_capture(fake):
    rec = fake()
    graphs = CudaGraphs(torch.device("cuda:1"))
    for _ in range(3):
        graphs.capture(_step(rec), {"x": torch.zeros(2)})
    assert [c for c in rec.calls if c[0] == "Stream"] == [
        ("Stream", torch.device("cuda:1"), rec.default[torch.device("cuda:1")], "cuda:1")
    ]


def test_a_failed_capture_puts_the_callers_stream_back(fake):
    rec = fake(fail=True)
    with pytest.raises(RuntimeError, match="capturing"):
        CudaGraphs(torch.device("cuda:0")).capture(_step(rec), {"x": torch.zeros(2)})
    last = [c for c in rec.calls if c[0] == "set_stream"][-1]
    assert last[3].name == "default:cuda:0"  # not the side stream the capture left current


def test_an_empty_graph_is_a_failed_capture(fake):
    rec = fake(empty=True)
    with pytest.raises(CaptureError, match="empty"):
        CudaGraphs(torch.device("cuda:0")).capture(_step(rec), {"x": torch.zeros(2)})


def test_replays_run_inside_the_graphs_device(fake):
    rec = fake()
    captured = CudaGraphs(torch.device("cuda:1")).capture(_step(rec), {"x": torch.zeros(2)})
    captured.replay({"x": torch.ones(2)})
    (replay,) = [c for c in rec.calls if c[0] == "replay"]
    assert replay[1] == torch.device("cuda:1")
    assert torch.equal(captured.inputs["x"], torch.ones(2))  # the static input got the new values


def test_a_process_owning_a_gpu_model_makes_its_device_current(monkeypatch):
    claimed = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: claimed.append(torch.device(d)))
    registry.claim_device("cuda:1")
    registry.claim_device("cpu")
    assert claimed == [torch.device("cuda:1")]


def test_the_engine_claims_its_targets_device(tiny_dir, monkeypatch):
    from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
    from ssdlocal.engine import Engine

    claimed = []
    monkeypatch.setattr(registry, "claim_device", claimed.append)
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32", device="cpu"), spec=SpecConfig(mode=Mode.AR)
    )
    with Engine(config):
        pass
    assert claimed == ["cpu"]  # a no-op there; on "cuda:1" it makes cuda:1 current


class _PerThreadDevice:
    """torch.cuda.set_device as CUDA keeps it: one current device per host thread."""

    def __init__(self) -> None:
        import threading

        self._local = threading.local()
        self.claims: list[tuple[str, torch.device]] = []  # (thread name, device)

    def set_device(self, device) -> None:
        import threading

        self._local.device = torch.device(device)
        self.claims.append((threading.current_thread().name, torch.device(device)))

    def current(self) -> torch.device:
        return getattr(self._local, "device", torch.device("cuda:0"))  # a new thread: cuda:0


def test_the_servers_engine_thread_claims_the_targets_device(monkeypatch):
    """`serve` makes the engine in the main thread; the engine runs in `ssdlocal-engine`,
    whose current device would otherwise be cuda:0."""
    from types import SimpleNamespace

    from ssdlocal.server.scheduler import Scheduler

    cuda = _PerThreadDevice()
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    engine = SimpleNamespace(config=SimpleNamespace(target=SimpleNamespace(device="cuda:1")), cancel=lambda: None)
    scheduler = Scheduler(engine, metrics=None, mode="ar")
    scheduler.start()
    scheduler.stop()
    assert cuda.claims == [("ssdlocal-engine", torch.device("cuda:1"))]


def test_the_chat_worker_claims_the_targets_device_before_generating(monkeypatch):
    """The TUI loads the engine in one thread and generates in a Textual worker thread:
    the worker makes the target's GPU current before its first engine call."""
    pytest.importorskip("textual")
    import asyncio
    from dataclasses import replace

    from support.fake_engine import FakeEngine, chat_settings, fake_config

    from ssdlocal.tui.app import ChatApp

    cuda = _PerThreadDevice()
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    config = fake_config()
    engine = FakeEngine(replace(config, target=replace(config.target, device="cuda:1")))
    seen = []  # the current device of the thread that runs each generate call
    generate = engine.generate
    engine.generate = lambda *a, **kw: (seen.append(cuda.current()), generate(*a, **kw))[1]

    async def chat() -> None:
        app = ChatApp(lambda: engine, engine.config, chat_settings(draft=engine.config.spec.draft, max_new_tokens=4))
        async with app.run_test(size=(120, 36)) as pilot:
            while app.loading:
                await pilot.pause(0.01)
            await pilot.pause()
            await pilot.press(*"hi", "enter")
            await pilot.pause()
            await app.workers.wait_for_complete()

    asyncio.run(chat())
    assert seen == [torch.device("cuda:1")]
