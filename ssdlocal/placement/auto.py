"""Automatic placement: `--target-device auto`, `--draft-device auto`, `--target-devices
auto`, and whether llama.cpp beats torch for a CPU-only run.

Sizes come from weights/size.py (headers only: the run dtype or the quantized layout; a
.gguf file loaded as floats counts by its size on disk). The planner (planner.py) puts the target on the GPUs (tensor parallel across
several) and the draft on a free GPU; with no GPU left for the draft it shares the
target's GPU when it fits there (a GPU draft outruns a CPU one). Pure apart from reading
headers, `detect()` and looking for llama_cpp (whether llama.cpp also runs on this
machine is the probe's question: backends/llamacpp/probe.py).
"""

from __future__ import annotations

import logging

from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import DType, Quantization

log = logging.getLogger(__name__)


def auto_devices(
    target: str,
    draft: str | None,
    dtype: DType,
    inventory=None,
    *,
    backend: BackendName = BackendName.TORCH,
    quantizations: tuple[Quantization, Quantization] = (Quantization.NONE, Quantization.NONE),
    draft_beside: bool = False,
):
    """(target devices, draft device) from the planner; `draft` None (no draft model) needs
    no device; `draft_beside`: `draft` is a draft head, planned on the target's device.

    Raises PlacementError (with a hint) when nothing fits.
    """
    from ssdlocal.placement.inventory import detect
    from ssdlocal.weights.size import attention_heads, checkpoint_gb, whole_gb
    from ssdlocal.placement.planner import plan_placement

    inventory = detect() if inventory is None else inventory
    if not inventory.gpus:
        return ("cpu",), "cpu"
    draft_gb = checkpoint_gb(draft, dtype, quantizations[1], "cuda") if draft else 0.0
    heads = attention_heads(target) if backend.tensor_parallel else ()
    target_gb = checkpoint_gb(target, dtype, quantizations[0], "cuda")
    whole = whole_gb(target, dtype, quantizations[0], "cuda") if backend.tensor_parallel else 0.0
    plan = plan_placement(inventory, target_gb, draft_gb, heads=heads, draft_beside=draft_beside, target_whole_gb=whole)
    draft_device = draft_device_of(plan, draft_gb) or "cpu"  # no room anywhere: the CPU, where RAM may swap
    log.info(
        "auto placement: target %s (TP=%d), draft %s", ",".join(plan.target_devices), plan.tensor_parallel, draft_device
    )
    return tuple(plan.target_devices), draft_device


def draft_device_of(plan, draft_gb: float) -> str | None:
    """Where `--draft-device auto` puts the draft for a planner's plan (what `devices` shows
    too): the plan's draft device, except that with no GPU left for it a draft that fits
    beside a GPU target shares the target's GPU (SD there beats a CPU draft). None: no room
    for a draft model anywhere."""
    from ssdlocal.placement.planner import OVERHEAD

    main = plan.target_devices[0]
    if plan.draft_device in ("cpu", None) and main.startswith("cuda") and draft_gb:
        room = next((u.headroom_gb for u in plan.uses if u.device == main and u.role.startswith("target")), 0.0)
        if room >= draft_gb * OVERHEAD + max(0.25, 0.1 * draft_gb):
            return main
    return plan.draft_device


def auto_draft_device(target_device: str, inventory=None) -> str:
    """The draft's device for an explicit target device: another GPU when there is one,
    else the target's own GPU, else the CPU."""
    if not target_device.startswith("cuda"):
        return "cpu"
    from ssdlocal.placement.inventory import detect

    inventory = detect() if inventory is None else inventory
    taken = target_device if ":" in target_device else "cuda:0"
    free = [f"cuda:{g.index}" for g in inventory.gpus if f"cuda:{g.index}" != taken]
    return free[0] if free else taken


def llamacpp_wins(target: str | None, target_device: str, inventory=None, installed=None) -> bool:
    """True when a CPU-only run of this target should use llama.cpp: the target is a GGUF
    file (or the built-in pair, which ships as GGUF), the machine has no GPU in play, and
    llama-cpp-python is installed (found, not imported: the probe runs it first;
    `installed()` overrides that check, e.g. to ask whether a build would be used)."""
    if target is not None and not target.lower().endswith(".gguf"):
        return False
    if target_device == "auto":
        from ssdlocal.placement.inventory import detect

        inventory = detect() if inventory is None else inventory
        if inventory.gpus:
            return False
    if installed is None:
        from ssdlocal.backends.llamacpp.probe import installed

    return installed()
