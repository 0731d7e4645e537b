"""Checkpoint tensors stored in another layout than our models hold, turned into ours as
they load: what an architecture's description calls packed (`Packed`, weights/formats/
arch.py), e.g. gpt-oss's experts as transformers saves them (gate and up fused with their
features interleaved, weights stored [E, in, out]) and as OpenAI publishes them (MXFP4), and
Qwen3-MoE / Qwen3.5-MoE experts as transformers holds them (gate_up_proj [E, 2I, H]: gate's
rows, then up's).

The loaders (float, int8/int4, tensor-parallel: backends/torch/loader.py, quant_load.py,
parallel/shard_loader.py) hand every packed tensor to one `Unpacker` and place what it
gives back like any tensor of ours. MXFP4 weights are dequantized to the load dtype here
(they are not kept packed): a bf16 load holds them as bf16, `--quantization int8/int4`
quantizes them from there. Knows no family and no file format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.weights.formats.arch import Architecture, Packed

# The 16 values of an MXFP4 element (E2M1: sign, two exponent bits, one mantissa bit), by code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROWS = 1 << 16  # blocks dequantized at a time (bounds the index temporaries)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 -> weights [..., out, in] in `dtype`. blocks [..., out, G, 16] uint8: 32 values
    per block, two per byte, the low nibble first; scales [..., out, G] uint8: each block's
    exponent plus 127 (E8M0), value = FP4_VALUES[code] * 2 ** (scale - 127). Computed as the
    format's reference does it (the table in `dtype`, then ldexp), so exact in any dtype
    whose range holds the values."""
    *lead, groups, width = blocks.shape
    if tuple(scales.shape) != (*lead, groups):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}")
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # [16]
    flat, exponents = blocks.reshape(-1, width), scales.reshape(-1, 1).to(torch.int32) - 127  # [R, 16], [R, 1]
    out = torch.empty(flat.shape[0], width * 2, dtype=dtype, device=blocks.device)  # [R, 32]
    for a in range(0, flat.shape[0], _ROWS):
        part, dst = flat[a : a + _ROWS], out[a : a + _ROWS]
        dst[:, 0::2] = table[(part & 0x0F).to(torch.int32)]
        dst[:, 1::2] = table[(part >> 4).to(torch.int32)]
        torch.ldexp(dst, exponents[a : a + _ROWS], out=dst)
    return out.view(*lead, groups * width * 2)  # [..., out, in]


def unpack(packed: Packed, stored: Tensor, dtype: torch.dtype, scales: Tensor | None = None) -> tuple[Tensor, ...]:
    """Our tensors (one per `packed.into`, contiguous) from a stored tensor: MXFP4 blocks
    (with their `scales`) dequantized to `dtype`, other tensors in their stored dtype."""
    if packed.mxfp4 == "blocks":
        assert scales is not None  # the Unpacker waits for them
        whole = dequantize_mxfp4(stored, scales, dtype)  # [..., out, in]
    else:
        whole = stored.transpose(-1, -2) if packed.transposed else stored  # [..., out, in] or [..., out]
    n, features = len(packed.into), -1 if packed.into[0].endswith(".bias") else -2
    if packed.layout == "halves":  # [..., n * out, (in)]: each of ours in turn
        return tuple(part.contiguous() for part in whole.chunk(n, dim=features))  # [..., out, (in)] each
    if features == -1:
        return tuple(whole[..., j::n].contiguous() for j in range(n))  # [..., out / n] each
    return tuple(whole[..., j::n, :].contiguous() for j in range(n))  # [..., out / n, in] each


class Unpacker:
    """One load's packed tensors: `add` each as it is read (our name, from
    `Architecture.from_checkpoint`) and place what it returns; MXFP4 blocks and scales
    wait for each other. `finish` refuses a load that left a part without its partner."""

    def __init__(self, arch: Architecture, dtype: torch.dtype) -> None:
        self.arch, self.dtype = arch, dtype
        self.waiting: dict[tuple[str, ...], dict[str, tuple[Packed, Tensor]]] = {}

    def claims(self, key: str) -> bool:
        return self.arch.packed(key) is not None

    def take(self, key: str, tensor: Tensor) -> dict[str, Tensor]:
        """Our tensors that checkpoint tensor `key` gives: `add`'s when it is packed, else
        itself under its name."""
        return self.add(key, tensor) if self.claims(key) else {key: tensor}

    def add(self, key: str, tensor: Tensor) -> dict[str, Tensor]:
        """Our tensors (name -> tensor) that `key` completes; {} while its partner is unread."""
        found = self.arch.packed(key)
        assert found is not None  # callers ask `claims` first
        packed, names = found
        self.arch.packed_shapes(key, packed, tuple(tensor.shape))  # refuses a shape that cannot hold ours
        if packed.mxfp4 is None:
            return dict(zip(names, unpack(packed, tensor, self.dtype), strict=True))
        parts = self.waiting.setdefault(names, {})
        parts[packed.mxfp4] = (packed, tensor)
        if len(parts) < 2:
            return {}
        del self.waiting[names]
        (blocks_of, blocks), (_, scales) = parts["blocks"], parts["scales"]
        return dict(zip(names, unpack(blocks_of, blocks, self.dtype, scales), strict=True))

    def finish(self, ckpt) -> None:
        if self.waiting:
            names, parts = next(iter(self.waiting.items()))
            missing = ({"blocks", "scales"} - set(parts)).pop()
            raise ModelLoadError(
                f"checkpoint {ckpt} holds MXFP4 {next(iter(parts))} of {', '.join(names)} without their {missing}",
                hint="the weights may be from an incomplete download; download the model again",
            )
