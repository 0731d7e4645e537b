"""torch's CPU int4 weight layouts, per instruction set (backends/torch/int4_cpu.py).

- every known layout packs and reads back each row exactly (pure numpy, any machine);
- the layout this process's kernel reads is the one its capability predicts, equals
  torch's own packer, and is found without a warning;
- the same in child processes pinned with ATEN_CPU_CAPABILITY to each kernel level this
  CPU can run (AVX-512 and AVX2 on an AVX-512 machine; a level it lacks is skipped, since
  torch would run it anyway and die with SIGILL): packing, QuantLinear's kernel, its
  de-quantized rows and float32 logit refinement. The ids and the recorded property
  `isa_paths` say which levels ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ssdlocal.backends.torch import int4_cpu
from ssdlocal.backends.torch.int4_cpu import LAYOUTS, capability, cpu_layout, expected_layout
from ssdlocal.core.cpu import runs_torch_level

ISA = capability().lower()
ROOT = Path(__file__).resolve().parent.parent


def random_codes(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K] int32 in 0..15, our codes uint8 [N, K/2], feature 2i high)."""
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    return q, ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.name for x in LAYOUTS])
def test_every_layout_reads_back_its_rows(layout):
    for n, k in ((16, 32), (64, 64), (96, 128), (176, 64), (2048 + 48, 32)):
        q, codes = random_codes(n, k, seed=n)
        packed = int4_cpu.pack(codes, layout)
        assert packed.shape == codes.shape and packed.dtype == torch.uint8
        rows = torch.randperm(n)[:40]
        assert torch.equal(int4_cpu.read_rows(packed, rows, layout).to(torch.int32), q[rows])
    with pytest.raises(ValueError, match="multiples of 16"):
        int4_cpu.pack(random_codes(24, 32)[1], layout)


@pytest.mark.parametrize("isa", [ISA])
def test_layout_in_force_matches_torch(isa, caplog, record_property):
    record_property("cpu_capability", isa)
    cpu_layout.cache_clear()
    with caplog.at_level("INFO", logger="ssdlocal.backends.torch.int4_cpu"):
        layout = cpu_layout()
    assert layout == expected_layout(isa), (isa, layout)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # healthy: silent
    for n, k in ((32, 64), (96, 256), (2048 + 64, 96), (80, 32)):
        q, codes = random_codes(n, k)
        assert torch.equal(int4_cpu.pack(codes, layout), torch._convert_weight_to_int4pack_for_cpu(q, 1))


_CHILD = textwrap.dedent(
    """
    import json, logging, torch
    logging.basicConfig(level=logging.INFO)
    from ssdlocal.backends.torch import int4_cpu
    from ssdlocal.backends.torch.logits import REFINED, fp32_logits
    from ssdlocal.backends.torch.quant import QuantLinear, quantize

    layout = int4_cpu.cpu_layout()
    q = torch.randint(0, 16, (96 + 16, 128), dtype=torch.int32)
    codes = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)
    same = torch.equal(int4_cpu.pack(codes, layout), torch._convert_weight_to_int4pack_for_cpu(q, 1))
    torch.manual_seed(0)
    w = torch.randn(72, 128) * 0.05
    qw = quantize(w, "int4", torch.bfloat16)
    lin = QuantLinear(qw, None, dtype=torch.bfloat16, device="cpu")
    idx = torch.tensor([[0, 71], [33, 64]])
    rows = lin.dequantize_rows(idx)
    h = torch.randn(2, 5, 128).bfloat16()
    exact = h.float() @ qw.dequantize().t()
    got = fp32_logits(lin, h)
    top = lin(h).float().topk(REFINED, dim=-1).indices
    print(json.dumps({
        "capability": int4_cpu.capability(), "layout": layout and layout.name,
        "packs_like_torch": same,
        "rows_exact": rows is not None and torch.equal(rows, qw.dequantize()[idx]),
        "kernel_err": float((lin(h).float() - exact).abs().max() / exact.abs().max()),
        "refined_exact": torch.allclose(got.gather(-1, top), exact.gather(-1, top), atol=1e-5),
    }))
    """
)


@pytest.mark.parametrize("pin", ["avx512", "avx2", "default"])
def test_each_isa_path_in_a_pinned_process(pin, record_property):
    """A child process pinned to one kernel level: the native layout equals torch's packer,
    the kernel multiplies by exactly the rows dequantize_rows returns, and an int4 head's
    best logits are refined in float32; nothing is logged (a healthy machine). A level
    this CPU cannot run is skipped: torch would run it anyway and die with SIGILL."""
    if runs_torch_level(pin) is False or (
        runs_torch_level(pin) is None and pin != "default" and pin.upper() != ISA.upper()
    ):
        pytest.skip(f"this CPU cannot run torch's {pin} kernels")
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": pin,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    record_property("isa_paths", f"asked {pin}, ran {got['capability']}")
    assert got["capability"].lower() == pin
    assert got["layout"] == expected_layout(got["capability"]).name
    assert got["packs_like_torch"] and got["rows_exact"] and got["refined_exact"], got
    assert got["kernel_err"] < 3e-2
    assert "WARNING" not in proc.stderr and "layout" not in proc.stderr, proc.stderr[-2000:]
