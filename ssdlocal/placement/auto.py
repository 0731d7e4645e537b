"""`--target-devices auto`: size the checkpoints and ask the planner (planner.py) where
the target (one device or a tensor-parallel group) and the draft go.

Sizes come from safetensors headers (no weights are read), scaled to the run dtype;
a .gguf file counts by its size on disk. Pure apart from reading headers and `detect()`.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_gb(path: str | Path, dtype: str) -> float:
    """Weights of a checkpoint in GB when loaded as `dtype` (header-only read)."""
    path = Path(path).expanduser()
    if path.is_file():  # .gguf: quantized on disk; the torch backend dequantizes to dtype
        return path.stat().st_size / 1e9
    numel = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                numel += n
    return numel * _BYTES.get(dtype, 2) / 1e9


def _heads(path: str | Path) -> tuple[int, ...]:
    from ssdlocal.backends.torch.loader import load_hf_config, resolve_checkpoint
    from ssdlocal.backends.torch.model import ModelArgs

    args = ModelArgs.from_hf_config(load_hf_config(resolve_checkpoint(path)))
    return (args.num_heads, args.num_kv_heads)


def auto_devices(target: str, draft: str | None, dtype: str, inventory=None):
    """(target devices, draft device) from the planner; draft None/'ngram' needs no device.

    Raises PlacementError (with a hint) when nothing fits.
    """
    from ssdlocal.placement.inventory import detect
    from ssdlocal.placement.planner import plan_placement

    inventory = detect() if inventory is None else inventory
    draft_gb = checkpoint_gb(draft, dtype) if draft and draft != "ngram" else 0.0
    plan = plan_placement(inventory, checkpoint_gb(target, dtype), draft_gb, heads=_heads(target))
    log.info("auto placement: target %s (TP=%d), draft %s", ",".join(plan.target_devices),
             plan.tensor_parallel, plan.draft_device)
    draft_device = plan.draft_device if plan.draft_device != "ngram" else "cpu"
    return tuple(plan.target_devices), draft_device
