"""The placement planner on fake machines (1, 2, 4+1, 8 GPUs, CPU only, mismatched GPUs,
plans that cannot fit), device detection on this machine, and `ssdlocal devices`."""

from __future__ import annotations

import json

import pytest
from support.cli import run_cli

from ssdlocal.core.errors import PlacementError
from ssdlocal.placement.inventory import GPU, DeviceInventory, detect, read_meminfo
from ssdlocal.placement.planner import plan_placement


def machine(*sizes_gb: float, cores: int = 32, ram_gb: float = 256.0, link: str = "unknown") -> DeviceInventory:
    nvlink = {"nvlink": True, "pcie": False}.get(link)
    gpus = tuple(GPU(i, f"GPU{i}", size, size - 0.5, nvlink) for i, size in enumerate(sizes_gb))
    return DeviceInventory(gpus, cores, ram_gb, ram_gb * 0.9, link)


H100 = 80.0
LLAMA_70B, LLAMA_8B, LLAMA_1B = 141.1, 16.1, 2.5
LLAMA_HEADS = (64, 8)


def test_one_gpu_target_on_it_draft_on_cpu():
    plan = plan_placement(machine(24.0), LLAMA_8B, LLAMA_1B)
    assert plan.target_devices == ("cuda:0",) and plan.tensor_parallel == 1
    assert plan.draft_device == "cpu" and plan.draft_kind == "cpu"
    assert plan.min_headroom_gb > 0
    assert any("no GPU left for the draft" in n for n in plan.notes)


def test_one_gpu_and_one_core_falls_back_to_ngram():
    plan = plan_placement(machine(24.0, cores=1), LLAMA_8B, LLAMA_1B)
    assert plan.target_devices == ("cuda:0",) and plan.draft_device is None and plan.draft_where == "n-gram"


def test_two_gpus_draft_gets_its_own():
    plan = plan_placement(machine(24.0, 24.0), LLAMA_8B, LLAMA_1B)
    assert plan.target_devices == ("cuda:0",) and plan.draft_device == "cuda:1"
    assert [u.role for u in plan.uses] == ["target", "draft"]


def test_two_gpus_target_needs_both_draft_goes_to_cpu():
    plan = plan_placement(machine(H100, H100), LLAMA_70B * 0.9, LLAMA_1B, heads=LLAMA_HEADS)
    assert plan.target_devices == ("cuda:0", "cuda:1") and plan.tensor_parallel == 2
    assert plan.draft_device == "cpu"


def test_four_plus_one_h100_target_tp4_draft_on_fifth():
    plan = plan_placement(machine(*[H100] * 5), LLAMA_70B, LLAMA_1B, heads=LLAMA_HEADS)
    assert plan.tensor_parallel == 4
    assert plan.target_devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert plan.draft_device == "cuda:4"
    assert all(u.headroom_gb > 0 for u in plan.uses)
    assert [u.role for u in plan.uses].count("target (TP shard)") == 4


def test_eight_gpus_keep_one_for_the_draft():
    nvlink = plan_placement(machine(*[H100] * 8, link="nvlink"), LLAMA_70B, LLAMA_1B, heads=LLAMA_HEADS)
    assert nvlink.tensor_parallel == 4 and nvlink.draft_device == "cuda:4"  # 8 would leave no GPU
    assert any("3 GPU(s) unused" in n for n in nvlink.notes)
    pcie = plan_placement(machine(*[H100] * 8, link="pcie"), LLAMA_8B, LLAMA_1B, heads=LLAMA_HEADS)
    assert pcie.tensor_parallel == 1 and pcie.draft_device == "cuda:1"  # fewest all-reduces
    big = plan_placement(machine(*[H100] * 8, link="nvlink"), LLAMA_8B, LLAMA_1B, heads=LLAMA_HEADS)
    assert big.tensor_parallel == 4 and big.draft_kind == "gpu"  # NVLink: more bandwidth


def test_tensor_parallel_degree_divides_the_heads():
    # Qwen2.5-7B: 28 query heads, 4 KV heads -> TP 8 is impossible
    plan = plan_placement(machine(*[10.0] * 8, link="nvlink"), 15.2, 1.0, heads=(28, 4))
    assert plan.tensor_parallel in (2, 4) and 28 % plan.tensor_parallel == 0


def test_a_draft_head_sits_beside_the_target_on_one_device():
    """A draft head reads the target's embedding and hidden states: it goes on the target's
    device, its bytes counted there, and the target is never split (no tensor parallelism)."""
    head_gb = 0.85
    plan = plan_placement(machine(24.0, 24.0), LLAMA_8B, head_gb, draft_beside=True)
    alone = plan_placement(machine(24.0, 24.0), LLAMA_8B, 0.0)
    assert plan.target_devices == ("cuda:0",) and plan.draft_device == "cuda:0" and plan.tensor_parallel == 1
    assert [u.role for u in plan.uses] == ["target + draft head"]
    head_need = head_gb * 1.05 + 0.25  # weights with the planner's overhead, and its cache's floor
    assert plan.uses[0].need_gb == pytest.approx(alone.uses[0].need_gb + head_need)
    assert any("1 GPU(s) unused" in n for n in plan.notes)
    # a target that needs two GPUs: split with a draft model, refused with a head
    assert plan_placement(machine(H100, H100), LLAMA_70B * 0.9, LLAMA_1B, heads=LLAMA_HEADS).tensor_parallel == 2
    with pytest.raises(PlacementError, match="1 GPU"):
        plan_placement(machine(H100, H100), LLAMA_70B * 0.9, head_gb, heads=LLAMA_HEADS, draft_beside=True)
    # a target that fits a GPU alone but not with its head
    target_gb = (machine(24.0).gpus[0].usable_gb - 1.0 - 0.1) / 1.05  # usable less its KV, 0.1 GB spare
    assert plan_placement(machine(24.0), target_gb, head_gb, kv_gb=1.0).target_devices == ("cuda:0",)
    with pytest.raises(PlacementError):
        plan_placement(machine(24.0), target_gb, head_gb, kv_gb=1.0, draft_beside=True)


def test_cpu_only():
    plan = plan_placement(machine(cores=16, ram_gb=64), 3.1, 1.0)
    assert plan.target_devices == ("cpu",) and plan.draft_device == "cpu"
    # no note that reads like SSD: the mode (SD, sharing the CPU) is placement/mode.py's to say
    assert not any("separate processes" in n for n in plan.notes)
    tight = plan_placement(machine(cores=16, ram_gb=24), LLAMA_8B, LLAMA_1B)
    assert tight.target_devices == ("cpu",) and tight.draft_device is None


def test_mismatched_gpus():
    plan = plan_placement(machine(12.0, 24.0), LLAMA_8B, LLAMA_1B)
    assert plan.target_devices == ("cuda:1",) and plan.draft_device == "cuda:0"  # big one for the target
    with pytest.raises(PlacementError) as info:
        plan_placement(machine(24.0, 12.0), 65.5, 1.0)
    assert "needs ~" in info.value.message and "2 GPUs" in info.value.message
    assert "ssdlocal pairs" in info.value.hint


@pytest.mark.parametrize(
    ("inventory", "needle"),
    [
        (machine(24.0), "1 GPU) offers"),
        (machine(cores=8, ram_gb=32), "no GPU found and RAM offers"),
        (machine(*[H100] * 4), "4 GPUs) offers"),
    ],
)
def test_plans_that_cannot_fit_are_refused(inventory, needle):
    with pytest.raises(PlacementError) as info:
        plan_placement(inventory, 400.0, 2.5, heads=LLAMA_HEADS)
    assert "the target needs ~" in info.value.message and needle in info.value.message


# The 2026 pairs (models/pairs) on 1, 2, 4 and 8 GPUs with NVLink: "TPn/draft" or "no".
# Their manifests' sizes: memory_gb for the backend and --quantization; tensor parallelism
# divides the heads (Qwen3-MoE's 4 key-value heads cap it at 4, so 8 GPUs give TP4 + a draft GPU).
NEW_PAIRS = [
    ("qwen3-30b-a3b", "torch", "none", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("qwen3-30b-a3b", "llamacpp", "auto", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("qwen3-235b-a22b", "torch", "none", 141.0, ["no", "no", "no", "no"]),  # TP <= 4 by its kv heads
    ("qwen3-235b-a22b", "torch", "int8", H100, ["no", "no", "TP4/cpu", "TP4/cuda:4"]),
    ("qwen3-235b-a22b", "torch", "int4", 141.0, ["no", "TP2/cpu", "TP2/cuda:2", "TP4/cuda:4"]),
    ("gpt-oss-120b", "torch", "none", H100, ["no", "no", "TP4/cpu", "TP4/cuda:4"]),
    ("gpt-oss-120b", "torch", "int4", H100, ["no", "TP2/cpu", "TP2/cuda:2", "TP4/cuda:4"]),
    ("gpt-oss-120b", "torch", "int4", 141.0, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("gemma-3-27b", "llamacpp", "auto", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("gemma-4-31b", "llamacpp", "auto", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    # the multimodal checkpoints' text models on the torch backend (54 and 61 GB in bf16)
    ("gemma-3-27b", "torch", "none", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("gemma-4-31b", "torch", "none", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
    ("qwen3.5-27b", "torch", "none", H100, ["TP1/cpu", "TP1/cuda:1", "TP2/cuda:2", "TP4/cuda:4"]),
]


@pytest.mark.parametrize(("name", "backend", "quantization", "gpu_gb", "want"), NEW_PAIRS)
def test_new_family_pairs_on_one_two_four_and_eight_gpus(name, backend, quantization, gpu_gb, want):
    from ssdlocal.core.models import BackendName
    from ssdlocal.weights.pairs import get_pair

    pair = get_pair(name)
    backend = BackendName(backend)
    assert backend in pair.backends
    target_gb, draft_gb = pair.memory_gb(backend, quantization)
    heads = (pair.target.heads, pair.target.kv_heads)  # as `devices` and `pairs` plan it
    got = []
    for n in (1, 2, 4, 8):
        try:
            plan = plan_placement(machine(*[gpu_gb] * n, link="nvlink"), target_gb, draft_gb, heads=heads)
        except PlacementError as exc:
            assert "the target needs ~" in exc.message
            got.append("no")
            continue
        assert all(u.headroom_gb >= 0 for u in plan.uses)
        got.append(f"TP{plan.tensor_parallel}/{plan.draft_where}")
    assert got == want


def test_free_memory_counts_not_total():
    busy = DeviceInventory((GPU(0, "busy", 24.0, 6.0), GPU(1, "idle", 24.0, 23.5)), 8, 64.0)
    plan = plan_placement(busy, LLAMA_8B, LLAMA_1B)
    assert plan.target_devices == ("cuda:1",) and plan.draft_device == "cuda:0"


def test_detect_this_machine_and_meminfo(tmp_path):
    inv = detect()
    assert inv.cpu_cores >= 1 and inv.ram_gb > 0
    assert inv.interconnect in ("nvlink", "pcie", "unknown")
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    8192000 kB\n")
    total, available = read_meminfo(str(fake))
    assert total == pytest.approx(16.777, abs=1e-3) and available == pytest.approx(8.389, abs=1e-3)
    assert read_meminfo(str(tmp_path / "missing")) == (0.0, None)


# ----------------------------------------------------------------------------- CLI
def test_devices_command_prints_the_plan(monkeypatch, capsys):
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(*[H100] * 5))
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-70b")
    assert code == 0, err
    assert "cuda:4" in out and "tensor-parallel degree 4" in out and "draft cuda:4" in out
    assert "flags: --target-devices cuda:0-3 --draft-device cuda:4" in out
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-70b", "--json")
    payload = json.loads(out)
    assert payload["plan"]["tensor_parallel"] == 4 and len(payload["devices"]["gpus"]) == 5


def test_devices_command_plans_a_head_pair_beside_its_target(monkeypatch, capsys):
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(24.0, 24.0))
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-8b-eagle3")
    assert code == 0, err
    assert "target + draft head" in out and "target cuda:0, eagle3 draft head beside it" in out
    assert "mode sd: a draft head drafts between verifications" in out
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-8b-eagle3", "--quantization", "int8")
    assert code == 0, err  # the target quantized, the head as it is
    assert "target weights: int8 from meta-llama/Llama-3.1-8B-Instruct" in out
    assert "draft weights: bf16 from yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (eagle3 head)" in out
    code, out, err = run_cli(monkeypatch, capsys, "devices", "--pair", "llama-3.1-8b-eagle3", "--json")
    payload = json.loads(out)
    assert payload["mode"]["mode"] == "sd" and payload["plan"]["draft_device"] == "cuda:0"


def test_devices_command_on_this_machine(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "devices")
    assert code == 0, err
    assert "qwen2.5-coder-1.5b-offline" in out and "cores" in out


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["devices", "--target-gb", "5000"], 1, ["the target needs ~", "smaller pair"]),
        (["devices", "--pair", "llama-3.1-70b"], 1, ["1 GPU) offers", "llamacpp"]),
        (["devices", "--pair", "nope"], 2, ["unknown pair 'nope'"]),
        (["devices", "--backend", "tpu"], 2, ["unknown backend"]),
    ],
)
def test_devices_bad_input_and_plans_that_do_not_fit(monkeypatch, capsys, args, code, needles):
    monkeypatch.setattr("ssdlocal.placement.inventory.detect", lambda: machine(24.0, ram_gb=32))
    got, _, err = run_cli(monkeypatch, capsys, *args)
    assert got == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    for needle in needles:
        assert needle in err, (needle, err)
