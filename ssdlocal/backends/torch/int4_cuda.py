"""tinygemm's CUDA int4 weight layout, written and read back in torch, so a packed weight
can be expanded to dense rows on its own device (a long prompt's dense matmul, float32
lm_head rows) without keeping a second copy of the codes.

`torch._convert_weight_to_int4pack(codes [N, K/2] uint8, tiles)` gives int32
[N/8, K/(16*tiles), 32, tiles/2]: blocks of 8 output rows x 16*tiles input features, each
block 32 lanes x tiles/2 words of 8 nibbles (ATen's int4mm.cu, the m16n8k16 B layout):
lane t of word j holds row t // 4 and the bytes 16j + t % 4 + 4i (i = 0..3) of that row;
byte i's high nibble (feature 2 * byte) goes to bits 4i..4i+3, its low nibble (feature
2 * byte + 1) to bits 16 + 4i... `layout_known(device, tiles)` checks this description
once per device against torch's own packer before anything relies on it. Knows nothing
about models or modules.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ROWS = 8  # output rows per block (the layout's n-tile)


@functools.cache
def _block_order(tiles: int) -> tuple[int, ...]:
    """For each nibble of a block, in storage order (lane, word, nibble): its place in
    the block's [8 rows, 16 * tiles features] row-major."""
    width = 16 * tiles
    order = []
    for t in range(32):
        for j in range(tiles // 2):
            for p in range(8):
                i, low = p % 4, p // 4
                byte = 16 * j + t % 4 + 4 * i
                order.append((t // 4) * width + 2 * byte + low)
    return tuple(order)


def block_order(tiles: int, device: torch.device) -> Tensor:
    """[128 * tiles] long on `device`: for each nibble of a block in storage order, its
    place in the block's rows x features. A module that unpacks inside captured steps
    makes it once and holds it as a buffer (a static tensor, sent before any capture)."""
    return torch.tensor(_block_order(tiles), dtype=torch.long).to(device)


def unpack(packed: Tensor, order: Tensor | None = None) -> Tensor:
    """tinygemm's int32 [N/8, K/(16*tiles), 32, tiles/2] -> codes q [N, K] uint8 (0..15),
    on `packed`'s device (any subset of its row blocks unpacks the same way); `order`:
    block_order(tiles, device), looked up when None."""
    n_tiles, k_tiles, lanes, words = packed.shape
    tiles = 2 * words
    order = block_order(tiles, packed.device) if order is None else order
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed[..., None] >> shifts) & 15  # [N/8, KT, 32, t/2, 8]
    blocks = torch.empty(n_tiles, k_tiles, ROWS * 16 * tiles, dtype=torch.uint8, device=packed.device)
    blocks[..., order] = nibbles.reshape(n_tiles, k_tiles, -1).to(torch.uint8)
    blocks = blocks.view(n_tiles, k_tiles, ROWS, 16 * tiles).permute(0, 2, 1, 3)  # [N/8, 8, KT, 16t]
    return blocks.reshape(n_tiles * ROWS, k_tiles * 16 * tiles)  # [N, K]


def pack(codes: Tensor, tiles: int) -> Tensor:
    """Our codes [N, K/2] uint8 (feature 2j high nibble, 2j+1 low) -> the layout above, in
    torch on any device (N % 8 == 0, K % (16 * tiles) == 0): what `unpack` reads and what
    torch's CUDA packer gives (`layout_known` checks that)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    q = torch.stack((codes >> 4, codes & 15), dim=-1).reshape(n, k).to(torch.int64)  # [N, K]
    blocks = q.view(n // ROWS, ROWS, k // (16 * tiles), 16 * tiles).permute(0, 2, 1, 3)  # [N/8, KT, 8, 16t]
    flat = blocks.reshape(n // ROWS, k // (16 * tiles), -1)[..., block_order(tiles, codes.device)]  # storage order
    nibbles = flat.view(n // ROWS, k // (16 * tiles), 32, tiles // 2, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)  # [8]
    words = (nibbles << shifts).sum(-1)  # [N/8, KT, 32, t/2] in 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


_KNOWN: dict[tuple[str, int], bool] = {}


def layout_known(device: torch.device, tiles: int) -> bool:
    """Whether torch's CUDA packer on `device` writes the layout described above (checked
    once per device and tile count on a small random matrix: two blocks each way)."""
    key = (str(device), tiles)
    if key not in _KNOWN:
        gen = torch.Generator().manual_seed(tiles)
        probe = torch.randint(0, 256, (2 * ROWS, 16 * tiles), generator=gen, dtype=torch.uint8)  # [16, K/2]
        try:
            theirs = torch._convert_weight_to_int4pack(probe.to(device), tiles).cpu()
            _KNOWN[key] = tuple(theirs.shape) == tuple(pack(probe, tiles).shape) and torch.equal(
                theirs, pack(probe, tiles)
            )
        except Exception as exc:  # noqa: BLE001 - no such kernel, a fake device: unknown
            log.debug("tinygemm layout not checked on %s: %s", device, exc)
            _KNOWN[key] = False
        if not _KNOWN[key]:
            log.info("tinygemm's int4 layout on %s is not the one known here: weights stay packed", device)
    return _KNOWN[key]
