"""Weight-only int8 / int4 linears, applied to a model from outside its code.

QuantizedWeight is the device-neutral form that checkpoints store (codes plus scales);
QuantLinear packs it for its device's kernel once, at construction, and runs that kernel;
quant_apply.py puts them in a model. Knows nothing about files or processes. docs/architecture.md
("Quantized weights") gives the layouts, the kernels and why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssdlocal.backends.torch import int4_cpu, int4_cuda
from ssdlocal.backends.torch.scratch import ScratchPool
from ssdlocal.core.errors import UsageError
from ssdlocal.core.quantization import INT4_GROUP, Quantization, can_quantize

# Which linears get quantized is their architecture's (arch.py: Linear.quantized). Embeddings
# and norms stay in the activation dtype; a tied lm_head gets its own quantized copy.
_CHUNK_ELEMENTS = 1 << 22  # quantize this many weights at a time: bounded float32 temporaries
# torch's CPU int4 / int8 kernels take the rows of x in blocks of 4; a partial block after
# whole ones costs as much as a whole one more, and a separate call for it costs less
# (docs/architecture.md, "Quantized weights": M=5 4.3 -> 3.4 ms on one 1536x8960 matrix).
_CPU_ROW_BLOCK = 4


@dataclass
class QuantizedWeight:
    """One Linear weight W [N out, K in], quantized; what checkpoints store.

    int8: codes int8 [N, K], scales [N]; W = codes * scale (symmetric, per output channel).
    int4: codes uint8 [N, K/2], input feature 2j in the high nibble and 2j+1 in the low one;
          scales, zeros [N, K/group]; W = (code - 8) * scale + zero (the kernels' convention).
    """

    scheme: Quantization  # INT8 or INT4 (a string, e.g. a checkpoint's, is parsed)
    codes: Tensor
    scales: Tensor
    zeros: Tensor | None = None
    group_size: int = 0

    def __post_init__(self) -> None:
        self.scheme = Quantization(self.scheme)
        if not self.scheme.quantized:
            raise ValueError(f"not a quantization scheme: {self.scheme}")

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return (n, k * 2) if self.scheme is Quantization.INT4 else (n, k)

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W [N, K] in `dtype` (computed in float32)."""
        if self.scheme is Quantization.INT8:
            return (self.codes.float() * self.scales.float()[:, None]).to(dtype)  # [N, K]
        n, k = self.shape
        q = torch.stack((self.codes >> 4, self.codes & 15), dim=-1).reshape(n, k)  # [N, K]
        return dequantize_int4(q, self.scales, self.zeros, self.group_size).to(dtype)  # [N, K]

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output features [start, stop) (tensor-parallel column split)."""
        zeros = None if self.zeros is None else self.zeros[start:stop].contiguous()
        return QuantizedWeight(
            self.scheme,
            self.codes[start:stop].contiguous(),
            self.scales[start:stop].contiguous(),
            zeros,
            self.group_size,
        )

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        """Input features [start, stop) (tensor-parallel row split); int4 needs whole groups."""
        if self.scheme is Quantization.INT8:  # per-output-channel scales hold for any slice of the inputs
            return QuantizedWeight(Quantization.INT8, self.codes[:, start:stop].contiguous(), self.scales)
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"int4 input slice [{start}, {stop}) is not aligned to groups of {g}")
        return QuantizedWeight(
            Quantization.INT4,
            self.codes[:, start // 2 : stop // 2].contiguous(),
            self.scales[:, start // g : stop // g].contiguous(),
            self.zeros[:, start // g : stop // g].contiguous(),
            g,
        )

    def permute_rows(self, index: Tensor) -> QuantizedWeight:
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedWeight(self.scheme, self.codes[index], self.scales[index], zeros, self.group_size)

    def tensors(self, prefix: str) -> dict[str, Tensor]:
        """Checkpoint entries: `<prefix>.codes`, `.scales` (and `.zeros` for int4)."""
        out = {f"{prefix}.codes": self.codes, f"{prefix}.scales": self.scales}
        if self.zeros is not None:
            out[f"{prefix}.zeros"] = self.zeros
        return out


def pack_int4(q: Tensor, scales: Tensor, zeros: Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """QuantizedWeight from int4 values q [N, K] (0..15) and float scales/zeros [N, K/group]."""
    q = q.to(torch.uint8)
    codes = (q[:, 0::2] << 4) | q[:, 1::2]  # [N, K/2]
    group = q.shape[1] // scales.shape[1]
    return QuantizedWeight(Quantization.INT4, codes.contiguous(), scales.to(dtype), zeros.to(dtype), group)


def quantize(w: Tensor, scheme: Quantization, dtype: torch.dtype) -> QuantizedWeight:
    """Quantize W [N, K] (any float dtype, on its own device) with scales in `dtype`, a row block at a time."""
    n, k = w.shape
    step = max(32, _CHUNK_ELEMENTS // k // 32 * 32)
    parts = [_quantize_rows(w[r : r + step].float(), scheme, dtype) for r in range(0, n, step)]
    if len(parts) == 1:
        return parts[0]
    zeros = None if scheme == Quantization.INT8 else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(
        scheme, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zeros, parts[0].group_size
    )


def _quantize_rows(w: Tensor, scheme: Quantization, dtype: torch.dtype) -> QuantizedWeight:
    """w [n, K] float32. Codes are rounded against the scales as stored (in `dtype`)."""
    if scheme == Quantization.INT8:
        scales = (w.abs().amax(dim=1) / 127).to(dtype)  # [n]
        sf = scales.float().masked_fill(scales == 0, 1.0)  # an all-zero row: any scale works
        codes = (w / sf[:, None]).round_().clamp_(-128, 127).to(torch.int8)  # [n, K]
        return QuantizedWeight(Quantization.INT8, codes, scales)
    if scheme != Quantization.INT4:
        raise ValueError(f"unknown quantization scheme {str(scheme)!r}")
    n, k = w.shape
    wg = w.view(n, k // INT4_GROUP, INT4_GROUP)  # [n, G, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [n, G]
    scales = ((hi - lo) / 15).to(dtype)  # [n, G]
    zeros = (lo + 8 * (hi - lo) / 15).to(dtype)  # [n, G]: the value code 8 stands for
    sf = scales.float().masked_fill(scales == 0, 1.0)  # a constant group: codes all 8
    q = ((wg - zeros.float()[..., None]) / sf[..., None] + 8).round_().clamp_(0, 15)  # [n, G, g]
    return pack_int4(q.view(n, k), scales, zeros, dtype)


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """Codes q [N, K] (0..15) with scales and zeros [N, K/group] -> float32 W [N, K]:
    W = (q - 8) * s + z, the convention of every int4 kernel here."""
    n, k = q.shape
    w = (q.float().view(n, k // group_size, group_size) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(n, k)  # [N, K]


# --------------------------------------------------------------------------- kernels


def int8_cuda_kernel() -> bool:
    """Whether this torch has a CUDA kernel for `torch._weight_int8pack_mm`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


def kernel_for(scheme: Quantization, device: torch.device, dtype: torch.dtype) -> str:
    """Which matmul runs a QuantLinear: see docs/architecture.md, "Quantized weights".

    On CUDA the weights stay in their quantized bytes (a decode step reads half or a
    quarter of the bfloat16 bytes): int4 through tinygemm, which takes bfloat16
    activations only, and int8 through torch's int8 kernel. What those cannot run is
    refused (UsageError) rather than expanded to float on every forward."""
    if device.type == "cpu":
        if scheme == Quantization.INT4 and not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return "int4_dequant"  # torch < 2.6: no CPU int4 kernel
        return f"{scheme}_cpu"
    if scheme == Quantization.INT4:
        if dtype != torch.bfloat16:
            raise UsageError(
                f"int4 weights on {device.type} run tinygemm, which takes bfloat16 activations, not "
                f"{str(dtype).removeprefix('torch.')}",
                "use --dtype bfloat16 with int4 there, or --quantization int8 / none for this dtype",
            )
        return "int4_cuda"
    if not int8_cuda_kernel():
        raise UsageError(
            f"int8 weights on {device.type} need torch's int8 matmul kernel (_weight_int8pack_mm), "
            f"which torch {torch.__version__} lacks there",
            "use --quantization int4 with --dtype bfloat16, or --quantization none, or a newer torch",
        )
    return "int8_cuda"


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W as int8 / int4 codes, packed for `device`'s kernel.

    `reduce`: a row-parallel shard (tensor parallelism): the partial output is summed
    over the ranks of `group` before the bias is added once.
    """

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        reduce: bool = False,
        group=None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = weight.shape
        self.scheme, self.group_size = weight.scheme, weight.group_size
        self.kernel = kernel_for(weight.scheme, device, dtype)
        self.reduce, self.group = reduce, group
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        self.layout: int4_cpu.Int4Layout | None = None  # the CPU int4 kernel's weight layout
        self.dtype = dtype
        self._dense: Tensor | None = None  # W [N, K] in `dtype` while `expanded()`
        self.tinygemm_readable = False  # int4_cuda: whether int4_cuda.unpack reads `packed`
        self._pack(weight, dtype, device)

    def _pack(self, w: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        n = w.shape[0]
        if self.kernel in ("int4_cpu", "int4_cuda"):
            multiple = 32 if self.kernel == "int4_cpu" else 8  # whole row blocks of the layouts
            w = _pad_rows(w, -n % multiple)
            # [K/group, N, 2]: (scale, zero) per group and output feature
            sz = torch.stack((w.scales.t(), w.zeros.t()), dim=-1).to(device, dtype).contiguous()
            self.register_buffer("scales_and_zeros", sz)
            if self.kernel == "int4_cpu":
                self.layout = int4_cpu.cpu_layout()  # None: an unknown layout, torch packs
                if self.layout is None:
                    packed = int4_cpu.pack_with_torch(w.codes)
                else:
                    packed = int4_cpu.pack(w.codes, self.layout)
            else:
                packed = _pack_int4_cuda(w.codes.to(device))
                tiles = packed.shape[-1] * 2
                self.tinygemm_readable = int4_cuda.layout_known(device, tiles)
                if self.tinygemm_readable:  # read by dequantize_rows inside captured steps
                    self.register_buffer("tinygemm_order", int4_cuda.block_order(tiles, device), persistent=False)
            self.register_buffer("packed", packed)
        elif self.kernel == "int4_dequant":
            self.register_buffer("codes", w.codes.to(device))
            self.register_buffer("scales", w.scales.to(device, dtype))
            self.register_buffer("zeros", w.zeros.to(device, dtype))
        else:  # int8: codes [N, K] int8 (one byte per weight, also on CUDA), scales [N]
            self.register_buffer("codes", w.codes.to(device))
            self.register_buffer("scales", w.scales.to(device, dtype))

    @contextmanager
    def expanded(self, pool: ScratchPool | None = None, dtype: torch.dtype | None = None) -> Iterator[None]:
        """Within: the weight held dense in `dtype` (default: the activation dtype), so inputs
        of many rows (a prompt) run through the dense matmul kernels, not the quantized ones
        made for a few rows (inputs are cast to `dtype` and back). A layout that is not ours
        to read (a CPU int4 layout torch packed itself, a tinygemm layout that failed its
        check) stays as it is. `pool` lends the memory (a prefill reuses one layer's buffers
        for the next layer)."""
        pool = ScratchPool() if pool is None else pool
        lent: list[Tensor] = []
        self._dense = self._dense_weight(pool, lent, dtype or self.dtype)
        try:
            yield
        finally:
            self._dense = None
            for t in lent:
                pool.give(t)

    @property
    def expandable(self) -> bool:
        """Whether `expanded` gives this kernel's weight a dense form."""
        return (
            self.kernel in ("int8_cpu", "int8_cuda", "int4_dequant")
            or (self.kernel == "int4_cpu" and self.layout is not None)
            or (self.kernel == "int4_cuda" and self.tinygemm_readable)
        )

    def _dense_weight(self, pool: ScratchPool, lent: list[Tensor], dtype: torch.dtype) -> Tensor | None:
        """W [out_features, in_features] in `dtype` (a view), or None; buffers taken from
        `pool` are added to `lent`."""
        n, k = self.out_features, self.kernel
        if not self.expandable:
            return None
        if k == "int4_cpu":
            rows, half = self.packed.shape
            shape, dev = (2 * half, rows), self.packed.device
            lent += [pool.take(shape, dtype, dev), pool.take(shape, torch.uint8, dev)]
            wt = int4_cpu.expand_transposed(
                self.packed, self.scales_and_zeros, self.group_size, self.layout, dtype, out=lent[-2], codes=lent[-1]
            )
            return wt[:, :n].t()  # [N, K]: a transposed view, which the matmul reads as is
        if k in ("int8_cpu", "int8_cuda"):
            return self.codes.to(dtype) * self.scales.to(dtype)[:, None]  # [N, K]
        if k == "int4_cuda":  # tinygemm's layout read back once, on the device
            return self._tinygemm_rows(None).to(dtype)  # [N, K]
        return QuantizedWeight(Quantization.INT4, self.codes, self.scales, self.zeros, self.group_size).dequantize(
            dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        k = self.kernel
        if self._dense is not None:
            out = F.linear(x2.to(self._dense.dtype), self._dense).to(x2.dtype)  # [M, N]
        elif k in ("int4_cpu", "int8_cpu"):
            m = x2.shape[0]
            whole = m // _CPU_ROW_BLOCK * _CPU_ROW_BLOCK
            if 0 < whole < m:  # e.g. a K=4 verify (M=5): 4 rows + 1 row beat 5 rows at once
                out = torch.cat([self._cpu_mm(x2[:whole]), self._cpu_mm(x2[whole:])])
            else:
                out = self._cpu_mm(x2)  # [M, N]
        elif k == "int4_cuda":  # tinygemm: bf16 x, groups of 32..256, scales_and_zeros [K/g, N, 2]
            out = torch._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        elif k == "int8_cuda":  # int8 codes, per-channel scales; float32 accumulation
            out = torch._weight_int8pack_mm(x2, self.codes, self.scales)  # [M, N]
        else:
            w = QuantizedWeight(Quantization.INT4, self.codes, self.scales, self.zeros, self.group_size)
            out = F.linear(x2, w.dequantize(x2.dtype))  # [M, N]
        if out.shape[-1] != self.out_features:  # rows padded for the kernel
            out = out[:, : self.out_features].contiguous()
        if self.reduce:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.group)  # [M, N] full sum over the ranks
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)

    def dequantize_rows(self, idx: Tensor) -> Tensor | None:
        """Output rows `idx` (any shape) of W as float32 [*idx.shape, in_features], exactly
        the values the kernel multiplies by; None where the packed layout is not ours to
        read (a tinygemm layout that failed its check, or a CPU whose int4 layout is none of
        int4_cpu.LAYOUTS). For tinygemm, the values in float32 ((q - 8) * s + z, as for
        every int4 kernel here; tinygemm rounds its own to bfloat16)."""
        flat = idx.reshape(-1)
        if self.kernel in ("int8_cpu", "int8_cuda"):
            rows = self.codes[flat].float() * self.scales[flat].float()[:, None]  # [R, K]
        elif self.kernel == "int4_dequant":
            w = QuantizedWeight(
                Quantization.INT4, self.codes[flat], self.scales[flat], self.zeros[flat], self.group_size
            )
            rows = w.dequantize(torch.float32)  # [R, K]
        elif self.kernel == "int4_cuda" and self.tinygemm_readable:
            rows = self._tinygemm_rows(flat)  # [R, K]
        elif self.kernel == "int4_cpu" and self.layout is not None:
            q = int4_cpu.read_rows(self.packed, flat, self.layout)  # [R, K]
            sz = self.scales_and_zeros[:, flat]  # [K/g, R, 2]
            rows = dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), self.group_size)  # [R, K]
        else:
            return None
        return rows.view(*idx.shape, self.in_features)

    def _tinygemm_rows(self, rows: Tensor | None) -> Tensor:
        """float32 W rows `rows` [R] (None: all N rows) read from tinygemm's packed layout:
        only the blocks of 8 rows that hold them are unpacked."""
        if rows is None:
            q = int4_cuda.unpack(self.packed, self.tinygemm_order)[: self.out_features]  # [N, K]
            sz = self.scales_and_zeros[:, : self.out_features]  # [K/g, N, 2]
        else:
            blocks = int4_cuda.unpack(self.packed[rows // int4_cuda.ROWS], self.tinygemm_order)  # [8R, K]
            q = blocks.view(rows.numel(), int4_cuda.ROWS, -1)[
                torch.arange(rows.numel(), device=rows.device), rows % int4_cuda.ROWS
            ]  # [R, K]
            sz = self.scales_and_zeros[:, rows]  # [K/g, R, 2]
        return dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), self.group_size)  # [R, K]

    def _cpu_mm(self, x2: Tensor) -> Tensor:
        if self.kernel == "int4_cpu":
            return torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        return torch._weight_int8pack_mm(x2, self.codes, self.scales)  # [M, N]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.scheme}, kernel={self.kernel}"


def _pad_rows(w: QuantizedWeight, extra: int) -> QuantizedWeight:
    """Append `extra` all-zero output rows (code 8, scale 0, zero 0)."""
    if extra == 0:
        return w
    k2, groups = w.codes.shape[1], w.scales.shape[1]
    return QuantizedWeight(
        Quantization.INT4,
        torch.cat([w.codes, torch.full((extra, k2), 0x88, dtype=torch.uint8)]),
        torch.cat([w.scales, w.scales.new_zeros(extra, groups)]),
        torch.cat([w.zeros, w.zeros.new_zeros(extra, groups)]),
        w.group_size,
    )


def _pack_int4_cuda(codes: Tensor) -> Tensor:
    """uint8 [N, K/2] on a GPU -> tinygemm's [N/8, K/(16*tiles), 32, tiles/2] int32 layout.

    tinygemm's own conditions (its CUDA kernel checks them; its fake/meta kernel does not,
    so they are checked here too): N % 8 == 0, K % (16 * tiles) == 0, tiles in 2/4/8."""
    n, k = codes.shape[0], codes.shape[1] * 2
    tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
    if n % 8 or k % (16 * tiles):
        raise ValueError(f"tinygemm int4 needs N % 8 == 0 and K % 32 == 0, got N={n}, K={k}")
    packed = torch._convert_weight_to_int4pack(codes.contiguous(), tiles)
    if tuple(packed.shape) != (n // 8, k // (16 * tiles), 32, tiles // 2):  # another layout
        raise RuntimeError(f"unexpected tinygemm packing {tuple(packed.shape)} for N={n}, K={k}")
    return packed


__all__ = [
    "QuantLinear",
    "QuantizedWeight",
    "can_quantize",
    "kernel_for",
    "pack_int4",
    "quantize",
]
