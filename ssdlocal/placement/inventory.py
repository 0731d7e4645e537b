"""What this machine has: GPUs (memory, interconnect), CPU cores and RAM.

`detect()` asks torch.cuda and NVML (pynvml, when importable) and never raises: what it
cannot find out is reported in `notes`. Imports nothing heavy at import time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

RESERVE_FRACTION = 0.08  # of each GPU's memory kept free: CUDA context, allocator slack
MIN_RESERVE_GB = 0.5


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    total_gb: float
    free_gb: float | None = None  # None when unknown: total is used
    nvlink: bool | None = None  # NVLink/P2P to the other GPUs; None = unknown

    @property
    def usable_gb(self) -> float:
        """Memory a model may use: free (or total) minus a reserve."""
        reserve = max(MIN_RESERVE_GB, RESERVE_FRACTION * self.total_gb)
        base = self.total_gb if self.free_gb is None else min(self.free_gb, self.total_gb)
        return max(0.0, base - reserve)


@dataclass(frozen=True)
class DeviceInventory:
    gpus: tuple[GPU, ...] = ()
    cpu_cores: int = 1
    ram_gb: float = 0.0  # total
    ram_available_gb: float | None = None
    interconnect: str = "unknown"  # "nvlink", "pcie", "unknown"
    notes: tuple[str, ...] = ()

    @property
    def ram_usable_gb(self) -> float:
        base = self.ram_gb if self.ram_available_gb is None else self.ram_available_gb
        return max(0.0, base - max(1.0, 0.1 * self.ram_gb))


def read_meminfo(path: str = "/proc/meminfo") -> tuple[float, float | None]:
    """(total GB, available GB) from /proc/meminfo; (0, None) where unreadable."""
    values: dict[str, float] = {}
    try:
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[key] = int(parts[0]) * 1024 / 1e9  # kB
    except OSError:
        return 0.0, None
    return values.get("MemTotal", 0.0), values.get("MemAvailable")


def _cpu_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _torch_gpus() -> list[GPU]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            free, total = torch.cuda.mem_get_info(i)
            free_gb = free / 1e9
        except RuntimeError:
            free_gb, total = None, props.total_memory
        found.append(GPU(i, props.name, total / 1e9, free_gb))
    return found


def _nvml_links(count: int) -> tuple[str, list[str]]:
    """'nvlink' / 'pcie' / 'unknown' for the GPU set, from NVML when pynvml is importable."""
    try:
        import pynvml
    except ImportError:
        return "unknown", ["pynvml not installed: interconnect unknown"]
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - any NVML failure just means "unknown"
        return "unknown", [f"NVML unavailable ({exc})"]
    try:
        links = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
                except Exception:  # noqa: BLE001 - link index not present
                    break
            links.append(active)
        if count > 1 and all(links):
            return "nvlink", []
        return ("pcie" if count > 1 else "unknown"), []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvmlShutdown failed: %s", exc)


def detect() -> DeviceInventory:
    """What this machine has. Never raises: unknowns are reported in `notes`."""
    gpus = _torch_gpus()
    notes: list[str] = []
    interconnect = "unknown"
    if len(gpus) > 1:
        interconnect, more = _nvml_links(len(gpus))
        notes += more
    total, available = read_meminfo()
    if not total:
        notes.append("RAM unknown (/proc/meminfo unreadable)")
    nvlink = {"nvlink": True, "pcie": False}.get(interconnect)
    gpus = [GPU(g.index, g.name, g.total_gb, g.free_gb, nvlink) for g in gpus]
    return DeviceInventory(tuple(gpus), _cpu_cores(), total, available, interconnect, tuple(notes))
