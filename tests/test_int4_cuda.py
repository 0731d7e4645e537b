"""tinygemm's CUDA int4 layout read back on the device: the layout as ATen's int4mm.cu
describes it, round trips for every tile count, and a QuantLinear holding it gives exactly
the int4 values (dense for long prompts, rows for the float32 lm_head refinement).
torch's own CUDA packer is compared with this description on a GPU (`layout_known`)."""

from __future__ import annotations

import pytest
import torch

from ssdlocal.backends.torch import int4_cuda, quant
from ssdlocal.backends.torch.quant import QuantLinear, quantize


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)  # [N, K/2]


@pytest.mark.parametrize("tiles", [2, 4, 8])
@pytest.mark.parametrize("n", [8, 24])
def test_pack_and_unpack_are_inverse(tiles, n):
    k = 16 * tiles * 3
    codes = _codes(n, k, tiles + n)
    packed = int4_cuda.pack(codes, tiles)
    assert packed.shape == (n // 8, k // (16 * tiles), 32, tiles // 2) and packed.dtype == torch.int32
    q = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(n, k)  # [N, K] feature 2j high nibble
    assert torch.equal(int4_cuda.unpack(packed), q)
    assert torch.equal(int4_cuda.unpack(packed[1:]), q[8:]) if n > 8 else True  # any row blocks


def test_the_layout_matches_int4mm_cu():
    """A few entries written out from the kernel's description: lane t, word j holds row
    t // 4 and bytes 16j + t % 4 + 4i; byte i's high nibble in bits 4i, low in 16 + 4i."""
    n, k, tiles = 8, 64, 4
    q = torch.arange(n * k).reshape(n, k) % 16  # [N, K]
    codes = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = int4_cuda.pack(codes, tiles).to(torch.int64) % 2**32  # [1, 1, 32, 2]
    nib = lambda word, p: int(word >> (4 * p)) & 15  # noqa: E731
    for t, j in [(0, 0), (5, 1), (31, 1)]:
        word = packed[0, 0, t, j]
        for i in range(4):
            byte = 16 * j + t % 4 + 4 * i
            assert nib(word, i) == q[t // 4, 2 * byte]
            assert nib(word, 4 + i) == q[t // 4, 2 * byte + 1]


def test_layout_known_is_false_without_torchs_cuda_packer():
    assert not int4_cuda.layout_known(torch.device("cpu"), 4)  # no CUDA kernel on this build


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tinygemm_linear_expands_to_its_int4_values(monkeypatch, dtype):
    """QuantLinear's int4_cuda path computed on the CPU: packed with the described layout
    (what torch's CUDA packer writes), expanded once and read row by row."""
    tiles_of = lambda codes: 8 if codes.shape[1] * 2 % 128 == 0 else 4  # noqa: E731
    monkeypatch.setattr(quant, "kernel_for", lambda scheme, device, dtype: "int4_cuda")
    monkeypatch.setattr(quant, "_pack_int4_cuda", lambda codes: int4_cuda.pack(codes, tiles_of(codes)))
    monkeypatch.setattr(int4_cuda, "layout_known", lambda device, tiles: True)
    gen = torch.Generator().manual_seed(5)
    qw = quantize(torch.randn(100, 192, generator=gen), "int4", dtype)  # 100 rows: padded to 104
    layer = QuantLinear(qw, None, dtype=dtype, device="cpu")
    exact = qw.dequantize(torch.float32)  # [N, K]
    assert layer.expandable
    with layer.expanded():
        assert torch.equal(layer._dense, exact.to(dtype))
    rows = torch.tensor([[0, 99], [57, 8]])
    assert torch.equal(layer.dequantize_rows(rows), exact[rows])
