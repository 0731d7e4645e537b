"""Tensor-parallel target on CPU (gloo, fp32, tiny models): TP=2 equals TP=1 token for
token (AR, SD, SSD), a killed or hung rank gives a clear error and leaves no process,
rank processes die with their parent; device-list parsing, q-channel selection and the
planner's TP choices. GPU checks are marked `gpu` (deselected by default).
"""

from __future__ import annotations

from dataclasses import replace

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.cli import run_cli
from support.host_reads import HostReads

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import TensorParallelError, UsageError
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine
from ssdlocal.ipc.qchannel import choose_q_channel, make_q_channel, write_q
from ssdlocal.parallel.group import backend_for
from ssdlocal.placement.devarg import format_devices, parse_devices, plan_flags
from ssdlocal.placement.inventory import GPU, DeviceInventory
from support.drafts import draft_of, row_views
from ssdlocal.core.config import NgramDraft

PROMPTS = ["The quick brown fox", "hello world, def foo(x):"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
TP2 = ("cpu", "cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _config(path, devices=(), mode=Mode.AR, draft=None) -> EngineConfig:
    return EngineConfig(
        target=ModelSpec(str(path), dtype="float32"),
        spec=SpecConfig(mode=mode, k=3, draft=draft_of(None if draft is None else str(draft))),
        pin_cpus=False,
        target_devices=devices,
    )


def _tokens(engine: Engine, spec: SpecConfig | None = None) -> list[tuple[int, ...]]:
    done = [e for e in engine.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)]
    return [o.token_ids for o in done[0].outputs]


def _rank_procs(engine: Engine):
    return list(engine.tp_group.procs)


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1_greedy(tiny_dir, arch):
    with Engine(_config(tiny_dir[arch])) as one:
        want = _tokens(one)
    with Engine(_config(tiny_dir[arch], TP2)) as two:
        procs = _rank_procs(two)
        assert two.runner.model.shard.args.num_kv_heads == 1  # 2 kv heads split over 2 ranks
        assert _tokens(two) == want
        assert two.runner.model.shard.layers[0].self_attn.kv_cache.k.shape[1] == 1  # [B, Hkv/TP, N, D]
        assert _tokens(two) == want  # a second call reuses the group (cache re-setup)
    assert all(not p.is_alive() for p in procs)


def test_sd_and_ssd_with_tp2_target_equal_ar(tiny_dir):
    with Engine(_config(tiny_dir["llama"], TP2, Mode.SSD, tiny_dir["draft_llama"])) as eng:
        ar = _tokens(eng, SpecConfig(mode=Mode.AR))
        ssd = _tokens(eng, SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(str(tiny_dir["draft_llama"]))))
        sd = _tokens(eng, SpecConfig(mode=Mode.SD, k=3, draft=draft_of(str(tiny_dir["draft_llama"]))))
        ngram = _tokens(eng, SpecConfig(mode=Mode.SD, k=3, draft=NgramDraft()))
    assert ssd == ar and sd == ar and ngram == ar


def test_tp2_reuses_prefixes_on_every_rank_and_equals_tp1(tiny_dir):
    """Calls that share a prefix: every rank copies its share of the KV in and out, the
    answers equal one process without the cache, and long prompts are read in chunks."""
    from ssdlocal.backends.torch import runner as runner_mod

    base = [(7 * i) % 300 + 5 for i in range(70)]
    calls = [[base], [base + [9, 8, 7]], [base[:40], base + [3] * 20]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def answers(engine):
        out = []
        for prompts in calls:
            done = [e for e in engine.generate(prompts, params) if isinstance(e, DoneEvent)][0]
            out.append(([o.token_ids for o in done.outputs], done.stats["cached_prompt_tokens"]))
        return out

    with Engine(replace(_config(tiny_dir["llama"]), prefix_cache_tokens=0)) as one:
        want = [tokens for tokens, _ in answers(one)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "PREFILL_CHUNK", 32)  # the prompts go in chunks through the group
        reads = HostReads(mp)
        chunked = runner_mod.TorchRunner._chunked_forward
        chunks = []

        def watched(self, *a, **k):  # no host wait per chunk: its span comes from host starts
            reads.active = True
            chunks.append(1)
            try:
                return chunked(self, *a, **k)
            finally:
                reads.active = False

        mp.setattr(runner_mod.TorchRunner, "_chunked_forward", watched)
        with Engine(_config(tiny_dir["llama"], TP2)) as two:
            got = answers(two)
    assert [tokens for tokens, _ in got] == want
    assert chunks and reads.count == 0
    assert [cached for _, cached in got] == [0, 64, 32 + 64]


def test_tp2_steps_replay_traced_graphs_and_equal_one_device(tiny_dir, monkeypatch):
    """SSDLOCAL_GRAPHS=trace: every rank captures its decode/tree steps (all_reduces inside
    the traced op graph) and replays them; AR, SD and SSD equal an eager single device."""
    draft = str(tiny_dir["draft_llama"])
    modes = [
        SpecConfig(mode=Mode.AR),
        SpecConfig(mode=Mode.SD, k=3, draft=draft_of(draft)),
        SpecConfig(mode=Mode.SSD, k=3, draft=draft_of(draft)),
    ]
    with Engine(replace(_config(tiny_dir["llama"], (), Mode.SSD, draft), graphs="off")) as one:
        want = [_tokens(one, spec) for spec in modes]
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "trace")
    captured = 0
    with Engine(_config(tiny_dir["llama"], TP2, Mode.SSD, draft)) as two:
        for spec, expected in zip(modes, want):
            done = [e for e in two.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
            assert [o.token_ids for o in done.outputs] == expected, spec.mode
            target = done.stats["graphs"]["target"]  # this call's counts
            assert target["mode"] == "trace" and target["dropped"] == target["refused"] == 0, target
            assert target["replays"] > 0, (spec.mode, target)
            captured += target["captured"]
        two.runner.graphs.clear()
        two.runner.graphs.max_graphs = 1  # past it rank 0 lets the least recently used go, and so do the ranks
        evicted = 0
        for spec, expected in list(zip(modes, want))[:2] * 2:  # AR's 1-token steps, SD's 4-token steps, again
            done = [e for e in two.generate(PROMPTS, GREEDY, spec=spec) if isinstance(e, DoneEvent)][0]
            assert [o.token_ids for o in done.outputs] == expected
            assert done.stats["graphs"]["target"]["refused"] == 0
            evicted += done.stats["graphs"]["target"]["evicted"]
        assert evicted >= 3
    assert captured > 0


# --------------------------------------------------------------------------- robustness


def test_a_capture_that_fails_on_one_rank_runs_eagerly_on_every_rank(tiny_dir, monkeypatch):
    """Rank 1's captures fail (tests/support/tp_faults.py): rank 0, which captured, refuses
    those shapes for every rank and runs them eagerly; the group stays up and equals one
    device (it used to end: the rank's error killed it while rank 0 would have fallen back)."""
    from ssdlocal.parallel import group as group_mod
    from support.tp_faults import rank_main_failing_capture

    with Engine(replace(_config(tiny_dir["llama"], ()), graphs="off")) as one:
        want = _tokens(one)
    monkeypatch.setattr(group_mod, "rank_main", rank_main_failing_capture)
    monkeypatch.setenv("SSDLOCAL_GRAPHS", "trace")
    with Engine(_config(tiny_dir["llama"], TP2)) as two:
        for _ in range(2):  # and again: the refused shapes stay eager, the group usable
            done = [e for e in two.generate(PROMPTS, GREEDY) if isinstance(e, DoneEvent)][0]
            assert [o.token_ids for o in done.outputs] == want
        target = done.stats["graphs"]["target"]
        assert target["replays"] == 0 and target["eager"] > 0 and target["dropped"] == 0
        assert two.runner.graphs.stats.refused > 0 and "injected" in two.runner.graphs.notes[0]
        assert not two.tp_group.broken


def test_a_read_back_waiting_on_a_hung_rank_has_a_deadline(monkeypatch):
    """On a GPU a rank hung inside a captured all-reduce keeps rank 0's stream from ever
    finishing, and the round's read-back blocked for ever; a tensor-parallel target bounds
    its reads (core.hostsync.Bound): past the deadline the group is spent and says so."""
    from ssdlocal.core.hostsync import Audit

    class Never:  # an event on a stream that never finishes
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return False

    class StuckLogits:  # what the round reads: a CUDA tensor whose stream never finishes
        is_cuda, device = True, torch.device("cuda:0")

        def tolist(self):
            raise AssertionError("the read blocked on the device with no deadline")

    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Never())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    spent = []
    audit = Audit()
    late = lambda s: spent.append(s) or TensorParallelError(f"a tensor-parallel step did not finish within {s} s")  # noqa: E731
    audit.bound("target", 0.05, late)
    with pytest.raises(TensorParallelError, match="did not finish within 0.05 s"):
        audit.site("target").read(StuckLogits())
    assert spent == [0.05]


def test_a_tensor_parallel_runner_bounds_its_reads(tiny_dir):
    with Engine(_config(tiny_dir["llama"], TP2)) as two:
        bound = two.audit.bounds["target"]
        assert bound.limit_s == two.tp_group.collective_timeout_s
        error = bound.late(bound.limit_s)
        assert "did not finish within" in error.message and two.tp_group.broken


def test_killed_rank_is_reported_and_nothing_is_left(tiny_dir):
    engine = Engine(_config(tiny_dir["llama"], TP2))
    procs = _rank_procs(engine)
    try:
        _tokens(engine)
        os.kill(procs[0].pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError) as info:
            _tokens(engine)
        assert "rank 1" in info.value.message and "SIGKILL" in info.value.message, info.value.message
        assert info.value.hint
        with pytest.raises(TensorParallelError):  # the group refuses further use
            _tokens(engine)
    finally:
        engine.close()
    assert all(not p.is_alive() for p in procs)
    with Engine(_config(tiny_dir["llama"], TP2)) as again:  # the process group was left cleanly
        assert len(_tokens(again)) == 2


def test_hung_rank_times_out_and_is_killed(tiny_dir, monkeypatch):
    from ssdlocal.parallel import group

    monkeypatch.setattr(group, "COLLECTIVE_TIMEOUT_S", 4.0)
    engine = Engine(_config(tiny_dir["llama"], TP2))
    procs = _rank_procs(engine)
    try:
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as info:
            _tokens(engine)
        assert time.monotonic() - t0 < 30
        assert "collective failed" in info.value.message or "did not answer" in info.value.message
    finally:
        engine.close()  # SIGTERM cannot reach a stopped process: close must SIGKILL it
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    assert all(not p.is_alive() for p in procs)


def test_a_rank_load_error_reaches_rank_0_with_its_cause(tmp_path):
    from ssdlocal.core.errors import ModelLoadError
    from ssdlocal.parallel.group import RankGroup

    group = RankGroup(ModelSpec(str(tmp_path / "missing"), dtype="float32"), TP2)  # rank 0 never loads it here
    try:
        with pytest.raises(ModelLoadError) as info:
            group.wait_loaded()
        assert "rank 1" in info.value.message and "does not exist" in info.value.message
        assert info.value.hint
    finally:
        group.close()
    assert all(not p.is_alive() for p in group.procs)


def test_one_group_per_process(tiny_dir):
    with Engine(_config(tiny_dir["llama"], TP2)):
        with pytest.raises(TensorParallelError, match="already running"):
            Engine(_config(tiny_dir["llama"], TP2))


def test_indivisible_heads_are_refused_before_spawning(tiny_dir):
    with pytest.raises(UsageError, match="divisible by 3"):
        Engine(_config(tiny_dir["llama"], ("cpu",) * 3))


_PARENT = """
import os, sys, time, torch
from ssdlocal.core.config import ModelSpec
from ssdlocal.parallel.group import load_tensor_parallel
if __name__ == "__main__":
    loaded, group = load_tensor_parallel(ModelSpec(sys.argv[1]), ("cpu", "cpu"))
    print(" ".join(str(p.pid) for p in group.procs), flush=True)
    time.sleep(600)
"""


def test_ranks_exit_when_the_parent_is_killed(tiny_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_dir["llama"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        line = proc.stdout.readline().decode().split()
        assert line, proc.stderr.read().decode()[-2000:]
        pids = [int(x) for x in line]
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs in the parent
        proc.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, "rank processes outlived their parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def test_cli_target_devices(tiny_dir, monkeypatch, capsys):
    import json

    common = [
        "generate",
        "The quick brown fox",
        "--target",
        tiny_dir["llama"],
        "--mode",
        "ar",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]
    code, out, err = run_cli(monkeypatch, capsys, *common)
    assert code == 0, err
    code, out_tp, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cpu*2")
    assert code == 0, err
    assert json.loads(out_tp)["outputs"] == json.loads(out)["outputs"]
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: DeviceInventory((), 2, 16.0))
    code, out_auto, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "auto")
    assert code == 0, err
    assert json.loads(out_auto)["outputs"] == json.loads(out)["outputs"]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cuda:3-1")
    assert code == 2 and "error: device range" in err and "hint: write cuda:1-3" in err


def test_check_target_devices(tiny_dir, monkeypatch, capsys):
    import json

    common = [
        "check",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--max-new-tokens",
        "6",
        "--k",
        "3",
        "--json",
    ]
    code, out, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cpu*2")
    assert code == 0, err
    report = json.loads(out)
    assert report["identical"] is True and [r["mode"] for r in report["runs"]] == ["ar", "sd", "ssd"]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cuda:3-1")
    assert code == 2 and "error: device range" in err and "hint: write cuda:1-3" in err


def test_bench_target_devices(tiny_dir, monkeypatch, capsys, tmp_path):
    import json

    common = [
        "bench",
        "--target",
        tiny_dir["llama"],
        "--draft",
        tiny_dir["draft_llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--no-chat",
        "--no-pin",
        "--ignore-eos",
        "--modes",
        "ar,sd",
        "--limit",
        "1",
        "--out",
        tmp_path,
    ]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cpu*2")
    assert code == 0, err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["settings"]["target_devices"] == ["cpu", "cpu"]
    assert doc["exactness"]["sd"]["status"] == "exact"
    code, _, err = run_cli(monkeypatch, capsys, *common, "--target-devices", "cuda:3-1")
    assert code == 2 and "error: device range" in err and "hint: write cuda:1-3" in err


def test_ctrl_c_during_tp_generate(tiny_dir):
    from support.processes import interrupt_while_streaming, wait_gone

    cmd = [
        sys.executable,
        "-m",
        "ssdlocal",
        "generate",
        "Hello world",
        "--target",
        str(tiny_dir["llama"]),
        "--mode",
        "ar",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "490",
        "--ignore-eos",
        "--target-devices",
        "cpu*2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        children = interrupt_while_streaming(proc)
        assert children, "rank 1 should be a child of the CLI"
        _, err = proc.communicate(timeout=15)
        err = err.decode()
        assert proc.returncode == 130, err
        assert "interrupted" in err and "Traceback" not in err, err
        assert not wait_gone(children, 5.0), "a rank survived Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- pure parts


def test_parse_devices():
    assert parse_devices("cuda:0-3") == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert parse_devices("cuda:0-1,cuda:4") == ("cuda:0", "cuda:1", "cuda:4")
    assert parse_devices("cuda:2-cuda:3") == ("cuda:2", "cuda:3")
    assert parse_devices("cpu*2") == ("cpu", "cpu") == parse_devices("cpu,cpu")
    assert parse_devices("cuda") == ("cuda:0",)
    for bad in ("cuda:3-1", "cuda:0,cuda:0", "cuda:0,cpu", "gpu0", "cuda:0,,cuda:1", "cuda:0-1,cuda:1"):
        with pytest.raises(UsageError):
            parse_devices(bad)
    assert format_devices(("cuda:0", "cuda:1", "cuda:2")) == "cuda:0-2"
    assert format_devices(("cuda:0", "cuda:2")) == "cuda:0,cuda:2"
    assert format_devices(("cpu", "cpu")) == "cpu*2"


def test_backend_choice():
    assert backend_for(("cpu", "cpu")) == "gloo"
    assert backend_for(("cuda:0", "cuda:1")) == "nccl"
    with pytest.raises(TensorParallelError):
        backend_for(("cuda:0", "cpu"))
    with pytest.raises(TensorParallelError):
        backend_for(("cuda:1", "cuda:1"))


def test_config_checks_target_devices():
    with pytest.raises(UsageError):
        EngineConfig(target=ModelSpec("x", dtype="float32"), target_devices=("cpu", "tpu:0"))
    with pytest.raises(UsageError, match="first of the target devices"):
        EngineConfig(target=ModelSpec("x", "cpu", dtype="float32"), target_devices=("cuda:0", "cuda:1"))


def test_q_channel_selection():
    linux = {"platform": "linux", "cuda_available": True}
    assert choose_q_channel("cuda:0", "cuda:4", **linux).kind == "cuda-ipc"
    assert choose_q_channel("cuda:0", "cuda:0", **linux).kind == "cuda-ipc"  # one GPU, two processes
    assert choose_q_channel("cuda:0", "cpu", **linux).kind == "shm"
    assert choose_q_channel("cpu", "cuda:0", **linux).kind == "shm"
    assert choose_q_channel("cpu", "cpu", **linux).kind == "shm"
    assert choose_q_channel("cuda:0", "cuda:1", platform="win32", cuda_available=True).kind == "shm"
    assert choose_q_channel("cuda:0", "cuda:1", platform="linux", cuda_available=False).kind == "shm"
    assert choose_q_channel("cuda:0", "cuda:1", force="shm", **linux).kind == "shm"
    with pytest.raises(UsageError):
        choose_q_channel("cpu", "cpu", force="cuda-ipc", **linux)
    with pytest.raises(UsageError):
        choose_q_channel("cpu", "cpu", force="carrier-pigeon", **linux)


def test_shm_channel_roundtrip():
    choice = choose_q_channel("cpu", "cpu")
    channel = make_q_channel(choice, batch=2, k=3, vocab=5)
    assert channel.buffer.is_shared()
    q = torch.rand(1, 3, 5)
    write_q(channel.buffer, q)
    got = channel.read()
    assert torch.equal(got[:1], q)
    channel.buffer.zero_()
    assert torch.equal(got[:1], q)  # read() returns a private copy


class _FakeWorker:
    """Stands in for DraftWorkerClient: records what SSDDrafter sends, answers READY."""

    timeout_s = 120.0  # DraftWorkerClient's receive deadline

    def __init__(self) -> None:
        self.sent = []
        self.timeouts = []

    def send(self, cmd, payload=None) -> None:
        self.sent.append((cmd, payload))

    def recv(self, expect, timeout_s=None):
        self.timeouts.append(timeout_s)
        return None


def _drafter(params, target_device, draft_device):
    from ssdlocal.draft.ssd.client import SSDDrafter

    spec = SpecConfig(mode=Mode.SSD, k=3, draft=draft_of("draft"))
    worker = _FakeWorker()
    drafter = SSDDrafter(
        worker,
        spec,
        SamplingParams(**params),
        target_vocab=5,
        num_slots=64,
        target_device=target_device,
        draft_device=draft_device,
    )
    return drafter, worker


def test_ssd_drafter_picks_cuda_ipc_for_two_gpus(monkeypatch):
    """cuda:0 target + cuda:1 draft: the q buffer is made as a cuda-ipc channel on the
    target's GPU (make_q_channel is mocked, so nothing is allocated on a GPU)."""
    import ssdlocal.draft.ssd.client as ssd_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "platform", "linux")
    made = []

    def fake_make(choice, batch, k, vocab, target_device="cpu"):
        made.append((choice.kind, batch, k, vocab, target_device))
        return SimpleNamespace(buffer="gpu-buffer")

    monkeypatch.setattr(ssd_mod, "make_q_channel", fake_make)
    drafter, worker = _drafter({"temperature": 1.0}, "cuda:0", "cuda:1")
    drafter.start(row_views([1, 2], [3]))
    assert made == [("cuda-ipc", 2, 3, 5, "cuda:0")]
    assert worker.sent[0][1].q_buffer == "gpu-buffer"


def test_ssd_drafter_q_channel_on_cpu_and_greedy():
    drafter, worker = _drafter({"temperature": 1.0}, "cpu", "cpu")
    drafter.start(row_views([1, 2]))
    buffer = worker.sent[0][1].q_buffer
    assert drafter._q_channel.kind == "shm" and buffer.is_shared() and buffer.shape == (1, 3, 5)
    greedy, worker = _drafter({"temperature": 0.0}, "cuda:0", "cuda:1")
    greedy.start(row_views([1, 2]))
    assert greedy._q_channel is None and worker.sent[0][1].q_buffer is None


def test_planner_chooses_tp_and_draft_gpu():
    from ssdlocal.placement.inventory import GPU, DeviceInventory
    from ssdlocal.placement.planner import plan_placement

    def inventory(n, link):
        return DeviceInventory(tuple(GPU(i, "GPU", 24.0) for i in range(n)), 16, 128.0, interconnect=link)

    heads = (32, 8)
    plan = plan_placement(inventory(2, "pcie"), 14.0, 1.0, heads=heads)
    assert plan.tensor_parallel == 1 and plan.draft_device == "cuda:1"
    plan = plan_placement(inventory(5, "nvlink"), 60.0, 1.0, heads=heads)
    assert plan.tensor_parallel == 4 and plan.draft_device == "cuda:4"
    assert plan_flags(plan) == "--target-devices cuda:0-3 --draft-device cuda:4"
    plan = plan_placement(inventory(8, "nvlink"), 14.0, 1.0, heads=heads)
    assert plan.tensor_parallel == 4 and plan.draft_device.startswith("cuda:")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_checks():
    """Runs scripts/gpu_check.py (needs CUDA): TP exactness on 2+ GPUs, SSD on GPUs, channel."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    script = Path(__file__).parents[1] / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (3, 5, 64), (1, 4, 9)])
def test_forward_inputs_pack_into_one_tensor(shape):
    from ssdlocal.parallel.rank import pack_inputs, packed_size, unpack_inputs

    B, T, S = shape
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + S)
    ids, positions, slots = (torch.randint(0, 999, (B, T), generator=gen) for _ in range(3))
    mask = torch.rand(B, T, S, generator=gen) > 0.5
    packed = pack_inputs(ids, positions, slots, mask)
    assert packed.dtype == torch.long and packed.numel() == packed_size(B, T, S)
    for got, want in zip(unpack_inputs(packed, B, T, S), (ids, positions, slots, mask)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shard_loader_reads_exactly_the_rank_slices(tiny_dir, arch):
    """Reading slices from safetensors == loading everything and sharding (tp.py)."""
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.parallel.shard_loader import load_shard
    from ssdlocal.parallel.tp import apply_tensor_parallel

    for rank in (0, 1):
        full = load_model(tiny_dir[arch])
        apply_tensor_parallel(full.model, rank, 2)
        shard = load_shard(ModelSpec(str(tiny_dir[arch]), dtype="float32"), "cpu", rank, 2, tokenizer=False)
        want, got = full.model.state_dict(), shard.model.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert shard.args == full.args and shard.model.args == full.model.args
        assert shard.model.args.num_heads * 2 == full.args.num_heads


def test_auto_devices_sizes_the_checkpoints_and_asks_the_planner(tiny_dir):
    from safetensors import safe_open

    from ssdlocal.placement.auto import auto_devices
    from ssdlocal.weights.size import checkpoint_gb

    path, draft = tiny_dir["llama"], tiny_dir["draft_llama"]
    numel = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            numel += sum(fh.get_tensor(k).numel() for k in fh.keys())
    assert checkpoint_gb(path, "float32") == pytest.approx(numel * 4 / 1e9)
    assert checkpoint_gb(path, "bfloat16") == pytest.approx(numel * 2 / 1e9)
    cpu_only = DeviceInventory((), 2, 16.0)
    assert auto_devices(str(path), str(draft), "float32", cpu_only) == (("cpu",), "cpu")
    three = DeviceInventory(tuple(GPU(i, "GPU", 24.0) for i in range(3)), 8, 64.0, interconnect="nvlink")
    assert auto_devices(str(path), str(draft), "float32", three) == (("cuda:0", "cuda:1"), "cuda:2")
    assert auto_devices(str(path), None, "float32", three)[0] == ("cuda:0", "cuda:1")
