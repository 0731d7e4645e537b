"""Safetensors files read and written one tensor at a time, with plain file I/O.

Reading copies each tensor into its own allocation: pages of a memory-mapped file that
were touched count as resident memory until the map closes, which doubles the peak of
a load. Writing streams each tensor's bytes, so a converter never holds the whole
model. The format is the public safetensors one (8-byte header size, JSON header,
data), so any safetensors reader opens these files. Knows nothing about models.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import torch
from torch import Tensor

from ssdlocal.core.errors import ModelLoadError

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


class DamagedFileError(ModelLoadError):
    """A safetensors file whose header or data cannot be read (truncated, garbled)."""


class SafetensorsReader:
    """Tensors of one .safetensors file by name; `read` returns a fresh CPU tensor.
    `on_read(nbytes)`, when given, is told the size of every tensor read (progress)."""

    def __init__(self, path: str | Path, on_read=None) -> None:
        self.path = Path(path)
        self.on_read = on_read
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ModelLoadError(
                f"{self.path} is not a regular file (a FIFO or a device?)", "replace it with the model's weight file"
            )
        os.set_blocking(fd, True)
        self._fh = os.fdopen(fd, "rb")  # noqa: SIM115 - closed by close()/__exit__
        try:
            (size,) = struct.unpack("<Q", self._fh.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(self._fh.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            _check_entries(header, os.fstat(fd).st_size - 8 - size)
        except (struct.error, ValueError, RecursionError) as exc:
            self._fh.close()
            raise DamagedFileError(
                f"{self.path} is not a readable safetensors file: {str(exc)[:200]}",
                "the download or conversion is incomplete; fetch the model again",
            ) from exc
        self._entries: dict[str, dict] = header
        self._data_start = 8 + size

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name ("BF16", "U8", ...)."""
        return self._entries[name]["dtype"]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> Tensor:
        """The tensor `name` (or only its rows [start, stop) along dim 0)."""
        entry = self._entries[name]
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // max(shape[0], 1)
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        out = torch.empty(end - begin, dtype=torch.uint8)
        self._fh.seek(self._data_start + begin)
        if self._fh.readinto(memoryview(out.numpy())) != end - begin:
            raise DamagedFileError(
                f"{self.path} is truncated at tensor {name}",
                "the download or conversion is incomplete; fetch the model again",
            )
        if self.on_read is not None:
            self.on_read(end - begin)
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> SafetensorsReader:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_entries(header: dict, data_bytes: int) -> None:
    """Every tensor entry names a known dtype, a shape of sizes and a byte range inside
    the file that holds exactly that many elements (ValueError otherwise)."""
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise ValueError(f"tensor {str(name)[:80]!r} has no known dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name[:80]!r} has a malformed shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {name[:80]!r} has malformed data offsets")
        begin, end = offsets
        size = _DTYPES[entry["dtype"]].itemsize
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= data_bytes or end - begin != count * size:
            raise ValueError(f"tensor {name[:80]!r} does not fit the file (truncated?)")


class MemoryReleaser:
    """Hands freed heap memory back to the OS every `every` bytes of tensors processed.

    glibc keeps freed blocks of up to 32 MB in the heap once blocks that large were
    freed, so a loader's per-tensor temporaries would otherwise add up in resident
    memory. malloc_trim costs a few milliseconds; a no-op where there is no glibc.
    """

    def __init__(self, every: int = 16 << 20) -> None:
        self.every, self.pending = every, 0
        try:
            import ctypes

            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def processed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            self.flush()

    def flush(self) -> None:
        if self._trim is not None:
            self._trim(0)
        self.pending = 0


class SafetensorsWriter:
    """Append tensors one at a time; `close` writes the file (data staged in `<path>.data`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._staged = self.path.with_name(self.path.name + ".data")
        self._fh = open(self._staged, "wb")  # noqa: SIM115 - closed by close()
        self._entries: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"duplicate tensor name {name!r}")
        t = tensor.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        self._fh.write(memoryview(raw.reshape(-1).numpy()))
        size = t.numel() * t.element_size()
        self._entries[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        self._offset += size

    def close(self, metadata: dict[str, str] | None = None) -> None:
        self._fh.close()
        header = dict(self._entries)
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, like the reference writer
        with open(self.path, "wb") as out, open(self._staged, "rb") as data:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(data, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        self._staged.unlink()

    def abort(self) -> None:
        self._fh.close()
        self._staged.unlink(missing_ok=True)
