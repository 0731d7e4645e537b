"""Read a GGUF file's header and its tensors a block of rows at a time, with plain file I/O.

The header reader skips the big string arrays (vocabulary, merges) instead of decoding
them, so it takes milliseconds. Rows come out either de-quantized (float32, through the
`gguf` package's numpy decoders) or, for Q4_0 / Q4_1 / Q4_K, as their exact 4-bit values
with one (scale, zero) pair per 32 weights: W = (q - 8) * scale + zero, which is the
int4 kernels' own convention, so those tensors change layout without losing anything.
Also says what `--quantization auto` means for a file (`gguf_scheme`). Knows nothing about
models or caches.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.paths import replace_hint
from ssdlocal.core.quantization import Quantization, scheme_for_gguf_type

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_FLOATS = {0: np.float32, 1: np.float16}  # F32, F16 (BF16 = 30 is decoded by the gguf package)
EXACT_INT4 = {2: "Q4_0", 3: "Q4_1", 12: "Q4_K"}  # ggml type ids whose values are int4 + (scale, min)
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, row length) for a matrix
    ggml_type: int
    offset: int  # absolute, in bytes from the start of the file

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"

    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.shape[-1] // block * size


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, object]  # string arrays appear as their length
    tensors: tuple[TensorInfo, ...]

    @classmethod
    def read(cls, path: str | Path) -> GGUFHeader:
        path = Path(path)
        try:
            return _parse(path)
        except (struct.error, UnicodeDecodeError, ValueError, OSError, MemoryError, OverflowError) as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {str(exc)[:200]}", replace_hint(path)) from exc


class _Buffer:
    """Sequential reads over the start of a file, growing the buffer as the parser needs."""

    def __init__(self, path: Path) -> None:
        self.path, self.data, self.pos = path, b"", 0
        self.size = path.stat().st_size

    def take(self, n: int) -> bytes:
        self._hold(self.pos + n)
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _hold(self, end: int) -> None:
        """The buffer holds the file up to `end` (ValueError past the file's end)."""
        if end > self.size:  # a length or count no file of this size can hold
            raise ValueError(f"the header runs to byte {end:,} of a file of {self.size:,} bytes")
        while end > len(self.data):
            with open(self.path, "rb") as fh:
                self.data = fh.read(max(2 * len(self.data), end, 1 << 20))
            if end > len(self.data):
                raise ValueError("unexpected end of file in the header")

    def skip_strings(self, count: int) -> None:
        """Past `count` length-prefixed strings, each length bounded by the file (a
        vocabulary's 151k strings in a tight loop: a call per string took 0.75 s)."""
        length, pos = struct.Struct("<Q").unpack_from, self.pos
        for _ in range(count):
            if pos + 8 > len(self.data):
                self._hold(pos + 8)
            end = pos + 8 + length(self.data, pos)[0]
            if end > len(self.data):
                self._hold(end)
            pos = end
        self.pos = pos

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        return self.take(n).decode("utf-8")


def _value(buf: _Buffer, kind: int):
    if kind in _SCALARS:
        return buf.unpack(_SCALARS[kind])[0]
    if kind == 8:
        return buf.string()
    if kind != 9:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = buf.unpack("<IQ")
    if count > buf.size - buf.pos:  # every item takes at least one byte
        raise ValueError(f"an array of {count:,} items in a file of {buf.size:,} bytes")
    if item in _SCALARS:
        return list(buf.unpack(f"<{count}{_SCALARS[item][1]}"))
    if item == 8:  # arrays of strings (vocabulary, merges): skip, keep the length
        buf.skip_strings(count)
        return count
    for _ in range(count):
        _value(buf, item)
    return count


def _parse(path: Path) -> GGUFHeader:
    buf = _Buffer(path)
    if buf.take(4) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    version, n_tensors, n_kv = buf.unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    if n_tensors > buf.size // 24 or n_kv > buf.size // 12:  # a tensor entry is >= 24 bytes, a key >= 12
        raise ValueError(f"the header claims {n_tensors:,} tensors and {n_kv:,} keys in {buf.size:,} bytes")
    metadata = {}
    for _ in range(n_kv):
        key = buf.string()
        metadata[key] = _value(buf, buf.unpack("<I")[0])
    table = []
    for _ in range(n_tensors):
        name = buf.string()
        (n_dims,) = buf.unpack("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name[:80]!r} has {n_dims:,} dimensions")
        dims = buf.unpack(f"<{n_dims}Q")
        kind, offset = buf.unpack("<IQ")
        table.append((name, tuple(reversed(dims)), kind, offset))
    align = int(metadata.get("general.alignment", 32))
    start = (buf.pos + align - 1) // align * align
    tensors = tuple(TensorInfo(n, s, k, start + o) for n, s, k, o in table)
    return GGUFHeader(path, metadata, tensors)


def gguf_scheme(gguf_path: Path, header: GGUFHeader | None = None) -> Quantization:
    """What `--quantization auto` means for this file: its file type's class
    (Q4_* / Q5_* -> int4, Q8_0 / Q6_K -> int8, floats -> none)."""
    header = header or GGUFHeader.read(gguf_path)
    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int):
        from gguf import LlamaFileType

        with contextlib.suppress(ValueError):
            return scheme_for_gguf_type(LlamaFileType(file_type).name)
    sizes: dict[str, int] = {}  # no file type: the type holding most matrix weights
    for t in header.tensors:
        if len(t.shape) == 2:
            sizes[t.type_name] = sizes.get(t.type_name, 0) + t.shape[0] * t.shape[1]
    return scheme_for_gguf_type(max(sizes, key=sizes.get)) if sizes else Quantization.NONE


# --------------------------------------------------------------------------- rows


def read_rows(path: Path, info: TensorInfo, start: int, stop: int) -> np.ndarray:
    """Raw bytes of rows [start, stop): uint8 [stop - start, row_bytes]."""
    row = info.row_bytes()
    raw = bytearray((stop - start) * row)  # writable: float rows reach torch as views of it
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [raw], info.offset + start * row)
    finally:
        os.close(fd)
    if got != len(raw):
        raise ModelLoadError(f"{path} is truncated inside tensor {info.name}", "fetch the file again")
    return np.frombuffer(raw, dtype=np.uint8).reshape(stop - start, row)


def dequantize_rows(path: Path, info: TensorInfo, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) as float32 [stop - start, row length]."""
    raw = read_rows(path, info, start, stop)
    if info.ggml_type in _FLOATS:
        return raw.view(_FLOATS[info.ggml_type]).astype(np.float32, copy=False)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        out = dequantize(raw, GGMLQuantizationType(info.ggml_type))
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(
            f"tensor {info.name} uses {info.type_name}, which cannot be decoded: {exc}",
            "use a GGUF with K-quants, Q4_0/Q5_0/Q8_0 or float tensors",
        ) from exc
    return np.asarray(out, dtype=np.float32).reshape(stop - start, info.shape[-1])


def int4_rows(path: Path, info: TensorInfo, start: int, stop: int):
    """Rows of a Q4_0 / Q4_1 / Q4_K tensor as (q uint8 [n, K] in 0..15, scale, zero float32
    [n, K/32]) with W = (q - 8) * scale + zero exactly (up to float32 rounding)."""
    raw = read_rows(path, info, start, stop)
    n, k = stop - start, info.shape[-1]
    kind = EXACT_INT4[info.ggml_type]
    if kind == "Q4_K":
        q, scale, low = _q4_k(raw.reshape(-1, 144))  # low: the value code 0 stands for
    else:
        width = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(-1, width)
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [nb, 1]
        qs = blocks[:, width - 16 :]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [nb, 32]: low nibbles first
        scale = d
        low = -8 * d if kind == "Q4_0" else blocks[:, 2:4].view(np.float16).astype(np.float32)
    zero = low + 8 * scale  # the value code 8 stands for
    return q.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)


def _q4_k(blocks: np.ndarray):
    """Q4_K super-blocks [nb, 144] -> q [nb, 256], scale and min-offset [nb, 8] (W = q*scale + low)."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [nb, 1]
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)  # [nb, 1]
    sc, m = _q4_k_scales(blocks[:, 4:16])  # [nb, 8] 6-bit each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(-1, 256)  # sub-block 2i: low nibbles of bytes 32i.., 2i+1: high nibbles
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k_scales(packed: np.ndarray):
    """12 bytes per super-block -> eight 6-bit scales and eight 6-bit mins (ggml's packing)."""
    packed = packed.reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins
