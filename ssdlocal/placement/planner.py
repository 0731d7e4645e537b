"""The placement planner: a pure function of a DeviceInventory and model sizes.

`plan_placement()` decides where the target goes (one GPU, a tensor-parallel group, or
the CPU), where the draft goes (its own GPU, the CPU, or the n-gram fallback; a draft head
beside the target, on its device), and the memory left on each device. Plans that cannot fit raise PlacementError naming the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ssdlocal.core.errors import PlacementError
from ssdlocal.placement.inventory import DeviceInventory

log = logging.getLogger(__name__)

OVERHEAD = 1.05  # activations and buffers on top of the weights


@dataclass(frozen=True)
class DeviceUse:
    device: str  # "cuda:0", "cpu"
    role: str  # "target", "target (TP shard)", "draft"
    need_gb: float
    usable_gb: float

    @property
    def headroom_gb(self) -> float:
        return self.usable_gb - self.need_gb


@dataclass(frozen=True)
class Plan:
    target_devices: tuple[str, ...]  # ("cuda:0", "cuda:1", ...) or ("cpu",)
    draft_device: str | None  # "cuda:N", "cpu", or None: no room for a draft model (n-gram drafting)
    tensor_parallel: int
    uses: tuple[DeviceUse, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def draft_kind(self) -> str:
        """Where the draft model runs: "gpu", "cpu", or "none" (it fits nowhere)."""
        if self.draft_device is None:
            return "none"
        return "gpu" if self.draft_device.startswith("cuda") else "cpu"

    @property
    def draft_where(self) -> str:
        """The draft's device for people: a device name, or "n-gram" when no model fits."""
        return self.draft_device or "n-gram"

    @property
    def min_headroom_gb(self) -> float:
        return min((u.headroom_gb for u in self.uses), default=0.0)


# --------------------------------------------------------------------------- planner


def _tp_degrees(n: int, heads: tuple[int, ...]) -> list[int]:
    """Powers of two <= n that divide every head count given."""
    degrees, d = [], 1
    while d <= n:
        if all(h % d == 0 for h in heads if h):
            degrees.append(d)
        d *= 2
    return degrees


def plan_placement(
    devices: DeviceInventory,
    target_gb: float,
    draft_gb: float,
    *,
    kv_gb: float | None = None,
    draft_kv_gb: float | None = None,
    heads: tuple[int, ...] = (),
    allow_cpu_target: bool | None = None,
    draft_beside: bool = False,
    target_whole_gb: float = 0.0,
) -> Plan:
    """Place a target of `target_gb` and a draft of `draft_gb` (weights, GB) on `devices`.

    Policy: the target takes the tensor-parallel group (power-of-two size dividing the
    head counts in `heads`) that fits while leaving a GPU for the draft; the draft takes
    the free GPU with the most room, else the CPU (needs 2+ cores for SSD), else the
    n-gram proposer. With NVLink the largest such group is chosen (more bandwidth), on
    PCIe or unknown links the smallest (fewer all-reduces). The CPU hosts the target
    only on machines without GPUs unless `allow_cpu_target`. `draft_beside`: the draft is a
    draft head, which reads the target's embedding and hidden states, so it sits on the
    target's one device (no tensor parallelism) and its bytes count there.
    `target_whole_gb`: the part of `target_gb` every tensor-parallel rank holds whole
    (weights/size.py `whole_bytes`: embeddings, norms, lm_head and the linears the
    architecture keeps replicated); a rank of a group of N holds it plus 1/N of the rest
    (and of the KV cache). Raises PlacementError.
    """
    kv_gb = max(1.0, 0.1 * target_gb) if kv_gb is None else kv_gb
    draft_kv_gb = max(0.25, 0.1 * draft_gb) if draft_kv_gb is None else draft_kv_gb
    need_t = target_gb * OVERHEAD + kv_gb
    need_d = draft_gb * OVERHEAD + draft_kv_gb
    if draft_beside:  # the head's weights and cache join the target's one device (1: no TP degree > 1 divides it)
        need_t, need_d, heads = need_t + need_d, 0.0, (1,)
    place, role = (_beside, _BESIDE) if draft_beside else (_with_draft, "target")
    gpus = sorted(devices.gpus, key=lambda g: (-g.usable_gb, g.index))
    if allow_cpu_target is None:
        allow_cpu_target = not gpus
    candidates: list[Plan] = []
    for tp in _tp_degrees(len(gpus), heads):
        group, rest = gpus[:tp], gpus[tp:]
        whole = min(target_whole_gb, target_gb) * OVERHEAD if tp > 1 else 0.0
        shard = (need_t - whole) / tp + whole  # what each rank of the group holds
        if shard > min(g.usable_gb for g in group):
            continue
        uses = [
            DeviceUse(f"cuda:{g.index}", role if tp == 1 else "target (TP shard)", shard, g.usable_gb) for g in group
        ]
        candidates.append(place(devices, tp, tuple(f"cuda:{g.index}" for g in group), uses, rest, need_d, 0.0))
    if not candidates and allow_cpu_target and need_t <= devices.ram_usable_gb:
        uses = [DeviceUse("cpu", role, need_t, devices.ram_usable_gb)]
        candidates.append(place(devices, 1, ("cpu",), uses, gpus, need_d, need_t))
    if not candidates:
        raise PlacementError(_why_not(devices, gpus, need_t, heads, allow_cpu_target), _fit_hint())
    rank = {"gpu": 0, "cpu": 1, "none": 2}
    prefer_big = devices.interconnect == "nvlink"
    return min(
        candidates,
        key=lambda p: (rank[p.draft_kind], -p.tensor_parallel if prefer_big else p.tensor_parallel),
    )


_BESIDE = "target + draft head"


def _beside(devices, tp, target_devices, uses, rest, need_d, cpu_used) -> Plan:
    """A draft head's plan: it runs on the target's device, counted in the target's use."""
    unused = len(rest)
    notes = (f"{unused} GPU(s) unused (a draft head runs on the target's device)",) if unused else ()
    return Plan(target_devices, target_devices[0], tp, tuple(uses), notes)


def _with_draft(devices, tp, target_devices, uses, rest, need_d, cpu_used) -> Plan:
    notes = []
    free = [g for g in rest if g.usable_gb >= need_d]
    if free:
        g = free[0]
        uses.append(DeviceUse(f"cuda:{g.index}", "draft", need_d, g.usable_gb))
        draft = f"cuda:{g.index}"
    elif devices.cpu_cores >= 2 and need_d <= devices.ram_usable_gb - cpu_used:
        uses.append(DeviceUse("cpu", "draft", need_d, devices.ram_usable_gb - cpu_used))
        draft = "cpu"
        if target_devices != ("cpu",):
            notes.append("no GPU left for the draft: it runs on the CPU (SSD overlaps it with the target)")
    else:
        draft = None
        notes.append("no room for the draft model: n-gram (prompt lookup) drafting instead")
    unused = len(rest) - (1 if draft and draft.startswith("cuda") else 0)
    if unused > 0:
        notes.append(f"{unused} GPU(s) unused")
    return Plan(target_devices, draft, tp, tuple(uses), tuple(notes))


def _why_not(devices, gpus, need_t, heads, allow_cpu_target) -> str:
    if gpus:
        degrees = _tp_degrees(len(gpus), heads)
        best = max(degrees) if degrees else 1
        offer = min(g.usable_gb for g in gpus[:best]) * best
        text = (
            f"the target needs ~{need_t:.1f} GB; the largest tensor-parallel group here "
            f"({best} GPU{'s' if best > 1 else ''}) offers ~{offer:.1f} GB usable"
        )
        if not allow_cpu_target:
            return text
        return text + f" and RAM offers ~{devices.ram_usable_gb:.1f} GB"
    return f"the target needs ~{need_t:.1f} GB; no GPU found and RAM offers ~{devices.ram_usable_gb:.1f} GB usable"


def _fit_hint() -> str:
    return (
        "choose a smaller pair (`ssdlocal pairs` marks what fits), a llama.cpp GGUF "
        "quantization (--backend llamacpp), or place models yourself with --target-device"
    )
