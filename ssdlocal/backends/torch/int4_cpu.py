"""torch's CPU int4 weight layouts: which one this process's kernel reads, built in numpy
from our codes and read back row by row, without torch's packer.

`torch._weight_int4pack_mm_for_cpu` reads its weights in a layout that depends on the
instruction set torch dispatched its CPU kernels to (ATen's int4mm_kernel.cpp), not on
the torch release: whole blocks of 64 rows (AVX-512) or 32 rows (AVX2) store row j's
value in the low nibble of byte j and row j + block/2's in its high nibble; other CPUs,
and the last partial block everywhere, pair neighbouring rows (row 2j low, 2j+1 high).
Each block holds `K` such runs of bytes, one per input feature. `cpu_layout()` names the
layout in force in this process: the one `torch.backends.cpu.get_cpu_capability()`
predicts, checked once against `torch._convert_weight_to_int4pack_for_cpu` (then the
other known ones). Knows nothing about models or modules.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 21  # pack this many bytes of codes at a time: bounded temporaries


@dataclass(frozen=True)
class Int4Layout:
    """Rows of a whole block of `block` are split in halves (`split`: byte j = row j |
    row j + block/2) or paired (byte j = row 2j | row 2j + 1); a last partial block is
    always paired. Rows come in multiples of 16 (the kernel's smallest block)."""

    name: str
    block: int
    split: bool

    def _halves(self, rows: int, whole: bool) -> tuple[np.ndarray, np.ndarray]:
        """(rows in low nibbles, rows in high nibbles) of one block of `rows` rows."""
        if whole and self.split:
            return np.arange(rows // 2), np.arange(rows // 2, rows)
        return np.arange(0, rows, 2), np.arange(1, rows, 2)


# What torch dispatches to, by torch.backends.cpu.get_cpu_capability(); the first three are
# the layouts of x86 builds (ATen's BLOCK_N = 4 vectors of floats), the rest cover builds
# with other vector widths that pair rows.
AVX512 = Int4Layout("avx512", 64, True)
AVX2 = Int4Layout("avx2", 32, True)
DEFAULT = Int4Layout("default", 32, False)
LAYOUTS = (AVX512, AVX2, DEFAULT, Int4Layout("pairs16", 16, False), Int4Layout("pairs64", 64, False))
_BY_CAPABILITY = {"AVX512": AVX512, "AVX2": AVX2}


def capability() -> str:
    """torch's CPU kernel level in this process ("AVX512", "AVX2", "DEFAULT", ...);
    ATEN_CPU_CAPABILITY=avx2 pins an AVX-512 machine to the AVX2 kernels."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # pragma: no cover - very old torch
        return "unknown"


def expected_layout(cap: str | None = None) -> Int4Layout:
    """The layout torch's source gives for kernel level `cap` (this process's by default)."""
    return _BY_CAPABILITY.get((cap or capability()).upper(), DEFAULT)


def pack(codes: Tensor, layout: Int4Layout) -> Tensor:
    """uint8 codes [N, K/2] (input feature 2i in the high nibble, N % 16 == 0) -> the
    kernel's uint8 [N, K/2] in `layout`: a few numpy byte operations per chunk of whole
    blocks, no int32 copy of the weights and no burst of small torch ops."""
    n, half = codes.shape
    if n % 16:
        raise ValueError(f"int4 CPU packing needs rows in multiples of 16, got {n}")
    src = codes.contiguous().numpy()
    out = np.empty((n, half), dtype=np.uint8)
    whole = n // layout.block * layout.block
    step = max(layout.block, _CHUNK_BYTES // half // layout.block * layout.block)
    for r in range(0, whole, step):
        stop = min(r + step, whole)
        out[r:stop] = _pack_blocks(src[r:stop], layout.block, *layout._halves(layout.block, True))
    if whole < n:
        out[whole:] = _pack_blocks(src[whole:], n - whole, *layout._halves(n - whole, False))
    return torch.from_numpy(out)


def _pack_blocks(src: np.ndarray, rows: int, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Codes [B*rows, K/2] of B blocks -> their packed bytes, [B*rows, K/2] in memory order."""
    half = src.shape[1]
    block = src.reshape(-1, rows, half)  # [B, rows, K/2]
    low_rows, high_rows = block[:, low], block[:, high]  # [B, rows/2, K/2] each
    even = (low_rows >> 4) | (high_rows & 0xF0)  # input features k = 2i
    odd = (low_rows & 0x0F) | (high_rows << 4)  # input features k = 2i + 1
    pairs = np.stack((even, odd), axis=-1).reshape(block.shape[0], rows // 2, 2 * half)  # [B, rows/2, K]
    return pairs.transpose(0, 2, 1).reshape(-1, half)  # [B, K, rows/2] -> rows of the output


def read_rows(packed: Tensor, rows: Tensor, layout: Int4Layout) -> Tensor:
    """Codes (0..15) of output rows `rows` [R] from a packed [N, K/2] weight -> uint8 [R, K]."""
    n, half = packed.shape
    k = 2 * half
    whole = n // layout.block * layout.block
    rows = rows.to(torch.long)
    in_whole = rows < whole
    size = torch.where(in_whole, layout.block, n - whole)  # [R] rows of the row's block
    start = torch.where(in_whole, rows // layout.block * layout.block, whole)  # [R]
    r = rows - start  # [R] position inside the block
    if layout.split:
        col = torch.where(in_whole, r % (layout.block // 2), r // 2)
        high = torch.where(in_whole, r >= layout.block // 2, r % 2 == 1)
    else:
        col, high = r // 2, r % 2 == 1
    feature = torch.arange(k)  # [K]
    offset = start[:, None] * half + feature[None] * (size[:, None] // 2) + col[:, None]  # [R, K]
    byte = packed.reshape(-1)[offset]  # [R, K]
    return torch.where(high[:, None], byte >> 4, byte & 15)  # [R, K]


def expand_transposed(
    packed: Tensor,
    scales_and_zeros: Tensor,
    group: int,
    layout: Int4Layout,
    dtype: torch.dtype,
    out: Tensor | None = None,
    codes: Tensor | None = None,
) -> Tensor:
    """The weight a packed [N, K/2] matrix stands for, transposed: W^T [K, N] in `dtype`,
    W = (code - 8) * scale + zero with scale and zero [K/group, N] from `scales_and_zeros`
    [K/group, N, 2]. `out` [K, N] `dtype` and `codes` [K, N] uint8 (scratch) may be given
    to reuse memory. In bfloat16 the offset `zero - 8 * scale` is rounded first (an error of
    at most a bfloat16 step of it: about 1/30 of a quantization step).

    Two cheap passes over the codes (nibbles out, transposed to feature-major) and one over
    the result (scale and offset, broadcast along each group): prefill expands each weight
    once per layer, so this runs once per layer and prompt."""
    n, half = packed.shape
    k = 2 * half
    out = torch.empty(k, n, dtype=dtype) if out is None else out
    codes = torch.empty(k, n, dtype=torch.uint8) if codes is None else codes
    whole = n // layout.block * layout.block
    if whole:
        _unpack_blocks(packed[:whole], layout.block, layout.split, codes[:, :whole])
    if whole < n:  # the last partial block pairs neighbouring rows
        _unpack_blocks(packed[whole:], n - whole, False, codes[:, whole:])
    scales = scales_and_zeros[..., 0].float()  # [K/g, N]
    offset = (scales_and_zeros[..., 1].float() - 8 * scales).to(dtype)[:, None]  # [K/g, 1, N]
    torch.addcmul(
        offset, codes.view(k // group, group, n), scales.to(dtype)[:, None], out=out.view(k // group, group, n)
    )
    return out


def _unpack_blocks(packed: Tensor, rows: int, split: bool, out: Tensor) -> None:
    """packed [B*rows, K/2] (B blocks of `rows`) -> codes out [K, B*rows] uint8 (0..15)."""
    n, half = packed.shape
    k, blocks = 2 * half, n // rows
    p = packed.reshape(blocks, k, rows // 2)  # [B, K, rows/2]: one run of bytes per feature
    low, high = (p & 15).transpose(0, 1), (p >> 4).transpose(0, 1)  # [K, B, rows/2] each
    o = out.unflatten(1, (blocks, rows))  # [K, B, rows]
    if split:  # low nibbles: the block's first half of rows, high nibbles: the second
        o[..., : rows // 2].copy_(low)
        o[..., rows // 2 :].copy_(high)
    else:  # rows 2j (low) and 2j + 1 (high)
        o.unflatten(2, (rows // 2, 2)).copy_(torch.stack((low, high), dim=-1))


@functools.lru_cache(maxsize=1)
def cpu_layout() -> Int4Layout | None:
    """The layout torch's CPU int4 kernel reads in this process, checked once against
    torch's own packer; None when it is none of the known ones (torch then packs)."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None  # torch < 2.6: no CPU int4 kernel
    cap = capability()
    q = torch.randint(0, 16, (176, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    codes = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)  # 176 rows: whole and partial blocks
    theirs = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    expected = expected_layout(cap)
    for layout in (expected, *(x for x in LAYOUTS if x != expected)):
        if torch.equal(pack(codes, layout), theirs):
            if layout != expected:
                log.info("torch's CPU int4 kernels (%s) read the %s layout", cap, layout.name)
            return layout
    log.warning(
        "torch's CPU int4 weight layout on this CPU (kernels: %s) is none of the known ones: "
        "torch packs the weights (slower loads) and int4 lm_heads skip float32 refinement",
        cap,
    )
    return None


def pack_with_torch(codes: Tensor) -> Tensor:
    """The fallback: torch's packer, 128 rows at a time (int32 temporaries stay small)."""
    out = torch.empty_like(codes)
    for r in range(0, codes.shape[0], 128):
        block = codes[r : r + 128]
        q = torch.stack((block >> 4, block & 15), dim=-1).reshape(block.shape[0], -1).to(torch.int32)
        out[r : r + 128] = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return out


__all__ = [
    "AVX2",
    "AVX512",
    "DEFAULT",
    "LAYOUTS",
    "Int4Layout",
    "capability",
    "cpu_layout",
    "expand_transposed",
    "expected_layout",
    "pack",
    "pack_with_torch",
    "read_rows",
]
