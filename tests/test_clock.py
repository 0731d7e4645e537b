"""core/clock.py in the round: drafting and verifying timed on the device, not on the host.

On a GPU the host only launches kernels, so host clocks around the drafter and the verify
measure launches. With a CUDA device clock (its events faked here: each records the time
the scripted device has reached, and every step a runner takes costs scripted device
milliseconds) while the host's clock races ahead a thousand seconds per reading, the
round's draft and verify seconds, and what the adaptive drafter's cost model learns from
them, are the device's; events are read after the round's read-back, never waited on."""

from __future__ import annotations

import time

import pytest
import torch

from ssdlocal.core import clock as clock_mod
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.sequence import Row
from ssdlocal.draft.adaptive import AdaptiveDrafter
from ssdlocal.draft.decode import Drafting
from ssdlocal.draft.sync import ModelDrafter
from ssdlocal.engine import round as round_mod
from ssdlocal.engine.prefill import read_prompts
from ssdlocal.engine.round import Round
from ssdlocal.speculation.adaptive import CostModel
from support.scripted import Names, ScriptedRunner, follow, sampling_of, seating_of

V, K = 16, 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=None)
TARGET_MS, DRAFT_MS = 5.0, 1.5  # device milliseconds per step


class Device:
    """The scripted device's timeline, and torch.cuda.Event stand-ins that read it."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.waited = 0
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at: float | None = None

            def record(self, stream=None) -> None:
                self.at = device.now_ms

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                device.waited += 1

            def elapsed_time(self, end) -> float:
                return end.at - self.at

        self.Event = Event

    def costing(self, step, ms: float):
        def timed(ids, bound=None, at=None):
            if at is None:  # ScriptedRunner's step `at` runs the whole step through `step` again
                self.now_ms += ms
            return step(ids, bound, at)

        return timed


@pytest.fixture
def device(monkeypatch):
    """A CUDA clock everywhere a round or drafter makes one; the host clock racing ahead."""
    dev = Device()
    monkeypatch.setattr(torch.cuda, "Event", dev.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    cuda = lambda device: clock_mod.DeviceClock(torch.device("cuda:0"))  # noqa: E731
    monkeypatch.setattr(round_mod, "DeviceClock", cuda)
    monkeypatch.setattr("ssdlocal.draft.sync.DeviceClock", cuda)
    host = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(host)))
    return dev


def test_the_cost_model_learns_the_device_seconds_not_the_host_clock(device):
    target = ScriptedRunner(follow(lambda t: (3 * t[-1] + 1) % V, V), V)
    draft = ScriptedRunner(follow(lambda t: (3 * t[-1] + 1) % V, V), V)
    target.step = device.costing(target.step, TARGET_MS)
    draft.step = device.costing(draft.step, DRAFT_MS)
    prompts, budget = [[1, 2, 3], [4, 5]], 13
    target.reset(2, 40)
    model = ModelDrafter(Drafting(draft, K, GREEDY, V), "cpu")
    model.reserve(2, 40)
    costs = CostModel()
    drafter = AdaptiveDrafter(model, None, k=K, pinned=True, params=GREEDY, costs=costs, target_vocab=V, device="cpu")
    rows = [Row(list(p), GREEDY, frozenset(), Names(), budget=budget) for p in prompts]
    seating = seating_of(target, rows, sampling_of(GREEDY, 2), drafter, K)
    first, _ = read_prompts(seating, CancelToken())
    drafter.start(rows)
    rnd = Round(seating, first)
    events = []
    for index in range(4):
        events += [e for e in rnd.run(index) if type(e).__name__ == "RoundEvent"]
    # a round drafts K tokens: one catch-up step and K-1 decode steps; the target scores once
    assert [e.verify_s for e in events] == pytest.approx([TARGET_MS / 1e3] * 4)
    assert [e.draft_s for e in events] == pytest.approx([K * DRAFT_MS / 1e3] * 4)
    assert costs.target_s(K + 1) == pytest.approx(TARGET_MS / 1e3)
    # per drafted token (the first round's reading of the prompt is discounted: AdaptiveDrafter._drafting_s)
    assert costs.draft_token_s == pytest.approx(DRAFT_MS / 1e3, rel=0.1)
    assert device.waited == 0  # every event had completed when it was read


def test_on_the_cpu_the_clock_is_the_hosts():
    clock = clock_mod.DeviceClock("cpu")
    a = clock.mark()
    b = clock.mark()
    assert isinstance(a, float) and clock.seconds(a, b) >= 0.0
