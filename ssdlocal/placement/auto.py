"""`--target-devices auto`: size the checkpoints and ask the planner (planner.py) where
the target (one device or a tensor-parallel group) and the draft go.

Sizes come from safetensors / GGUF headers (no weights are read), scaled to the run
dtype or to the quantized layout; a .gguf file loaded as floats counts by its size on disk. Pure apart from reading headers and `detect()`.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_gb(path: str | Path, dtype: str, quantization: str = "none") -> float:
    """Weights of a checkpoint in GB when loaded as `dtype` with `quantization`
    (header-only read; quantized sizes count codes + scales, see core/quantization.py)."""
    path = Path(path).expanduser()
    if quantization != "none":
        from ssdlocal.backends.torch.quant_load import resolve_scheme, weight_bytes

        scheme = resolve_scheme(path, quantization)
        if scheme != "none":
            return weight_bytes(path, scheme, dtype) / 1e9
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
    from ssdlocal.backends.torch.loader import config_dir, load_hf_config
    from ssdlocal.backends.torch.model import ModelArgs

    args = ModelArgs.from_hf_config(load_hf_config(config_dir(path)))
    return (args.num_heads, args.num_kv_heads)


def auto_devices(target: str, draft: str | None, dtype: str, inventory=None, *,
                 quantizations: tuple[str, str] = ("none", "none")):  # fmt: skip
    """(target devices, draft device) from the planner; draft None/'ngram' needs no device.

    Raises PlacementError (with a hint) when nothing fits.
    """
    from ssdlocal.placement.inventory import detect
    from ssdlocal.placement.planner import plan_placement

    inventory = detect() if inventory is None else inventory
    draft_gb = checkpoint_gb(draft, dtype, quantizations[1]) if draft and draft != "ngram" else 0.0
    target_gb = checkpoint_gb(target, dtype, quantizations[0])
    plan = plan_placement(inventory, target_gb, draft_gb, heads=_heads(target))
    log.info("auto placement: target %s (TP=%d), draft %s", ",".join(plan.target_devices),
             plan.tensor_parallel, plan.draft_device)
    draft_device = plan.draft_device if plan.draft_device != "ngram" else "cpu"
    return tuple(plan.target_devices), draft_device
