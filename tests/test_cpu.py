"""core/cpu.py: which of torch's kernel levels a CPU's flags can run."""

from __future__ import annotations

import pytest

from ssdlocal.core import cpu


@pytest.fixture
def flags(monkeypatch):
    def use(names: str, machine: str = "x86_64"):
        monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(names.split()))
        monkeypatch.setattr(cpu.platform, "machine", lambda: machine)

    return use


def test_an_avx2_cpu_runs_avx2_and_default_but_not_avx512(flags):
    flags("fpu sse4_2 avx avx2 fma avx_vnni")
    assert cpu.runs_torch_level("avx512") is False
    assert cpu.runs_torch_level("AVX2") is True
    assert cpu.runs_torch_level("default") is True


def test_avx512_needs_the_subsets_torch_checks(flags):
    flags("avx2 fma avx512f")  # AVX-512 foundation alone is not torch's AVX512 level
    assert cpu.runs_torch_level("avx512") is False
    flags("avx2 fma avx512f avx512vl avx512bw avx512dq")
    assert cpu.runs_torch_level("avx512") is True


def test_unknown_flags_or_other_architectures_say_unknown(flags):
    flags("")
    assert cpu.runs_torch_level("avx2") is None
    flags("fp asimd", machine="aarch64")
    assert cpu.runs_torch_level("avx2") is None
    assert cpu.runs_torch_level("default") is True


def test_this_machine_reads_its_own_flags():
    cpu.cpu_flags.cache_clear()
    got = cpu.cpu_flags()
    assert isinstance(got, frozenset)
    if got and cpu.platform.machine() == "x86_64":
        assert "sse2" in got  # every x86-64 CPU has it
        assert cpu.flags_summary().startswith("x86_64 ")
