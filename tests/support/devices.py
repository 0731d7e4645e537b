"""Machines for placement tests: a DeviceInventory with the GPUs a test names."""

from __future__ import annotations

from ssdlocal.placement.inventory import GPU, DeviceInventory


def machine(*gpus_gb: float) -> DeviceInventory:
    return DeviceInventory(tuple(GPU(i, "GPU", gb, gb) for i, gb in enumerate(gpus_gb)), 16, 64.0)
