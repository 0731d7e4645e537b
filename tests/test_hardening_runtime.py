"""Hardening of running engines: the tensor-parallel rendezvous listens on loopback only,
cancellation reaches the call it was meant for, quitting a TUI while models load returns
at once, both models' context lengths are respected (chat trims its history), and the
SSD worker's deadline for the prompt's prefill grows with the prompt.
"""

from __future__ import annotations

import ipaddress
import os
import sys

import pytest
import torch

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.engine import Engine

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# --------------------------------------------------------------------------- network
def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[len("socket:[") : -1])
    return found


def _address(hex_ip: str) -> ipaddress._BaseAddress:
    """/proc/net/tcp{,6} local address (little-endian 32-bit words) -> ip address."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_addresses(pids: list[int]) -> list[str]:
    """'ip:port' of every listening TCP socket owned by `pids`."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    ip, port = local.split(":")
                    found.append(f"{_address(ip)}:{int(port, 16)}")
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@linux_only
def test_tensor_parallel_rendezvous_listens_on_loopback_only(tiny_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = EngineConfig(target=ModelSpec(str(tiny_dir["llama"])), pin_cpus=False,
                          target_devices=("cpu", "cpu"))
    with Engine(config) as engine:
        pids = [os.getpid(), *(p.pid for p in engine._tp_group.procs)]
        listening = listening_addresses(pids)
        assert listening, "the rendezvous store should be listening"
        exposed = [a for a in listening if not _is_loopback(a)]
        assert not exposed, f"listening beyond this machine: {exposed}"
        done = list(engine.generate(["hello"], SamplingParams(max_new_tokens=3)))
        assert done[-1].outputs[0].token_ids
