"""A GGUF file's tensors as the pieces of our checkpoint, named and ordered as our loaders
read them: what both GGUF converters (the float one, weights/formats/convert.py, and the
int8/int4 one, backends/torch/gguf_quant.py) walk.

Everything comes from the architecture's description (weights/formats/arch.py): our name
for each GGUF tensor, llama.cpp's q/k row order undone where it interleaves them, what
llama.cpp added to norm weights taken off (`gguf_norm_shift`), and routed experts, which GGUF files stack ([E, out, in]: ggml dims [in, out, E]), cut into one
piece per expert under the checkpoint's per-expert name (`mlp.experts.{e}.up_proj`, what
published checkpoints hold and every loader stacks). A piece is a range of the tensor's
rows, read a block of rows at a time (float32 through weights/formats/gguf.py), so nothing
holds a whole model. Config fields the file states and transformers' GGUF reader does not
set are the description's `gguf_config` (`gguf_config_fields`). Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numpy as np

from ssdlocal.weights.formats.arch import Architecture, expert_pattern
from ssdlocal.weights.formats.gguf import GGUFHeader, TensorInfo, dequantize_rows
from ssdlocal.weights.formats.gguf_config import llamacpp_fields

ROWS_ELEMENTS = 1 << 20  # weights per block of rows read from a GGUF
_STACK = re.compile(r"\.experts\.")


def tensor_rows(info: TensorInfo) -> int:
    """Rows of a tensor seen as a matrix [rows, row length] (1 for a vector)."""
    return prod(info.shape[:-1]) if len(info.shape) > 1 else 1


def one_expert(module: str, e: int) -> str:
    """Expert `e`'s module of a stacked one ("layers.3.mlp.experts.up_proj" ->
    "layers.3.mlp.experts.5.up_proj")."""
    return _STACK.sub(f".experts.{e}.", module, count=1)


@dataclass(frozen=True)
class Piece:
    """One tensor of our checkpoint, read from rows [start, stop) of GGUF tensor `info`.

    name: ours ("layers.3.mlp.experts.5.gate_proj.weight"); shape: its shape (one expert's
    [out, in] for a piece of a stacked tensor); row_order: the index that puts llama.cpp's
    interleaved q/k rows back in Hugging Face order (None: already in it); shift: what
    llama.cpp added to every value (the description's `gguf_norm_shift`, on norm weights)."""

    name: str
    info: TensorInfo
    start: int
    stop: int
    shape: tuple[int, ...]
    row_order: np.ndarray | None = field(default=None, compare=False)
    shift: float = 0.0

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def file_bytes(self) -> int:
        """Bytes of the GGUF file this piece reads."""
        return (self.stop - self.start) * self.info.row_bytes()

    def row_blocks(self) -> Iterator[tuple[int, int]]:
        """The piece's rows as [start, stop) ranges of the tensor, about ROWS_ELEMENTS each
        (multiples of 32 rows)."""
        step = max(32, ROWS_ELEMENTS // self.info.shape[-1] // 32 * 32)
        for start in range(self.start, self.stop, step):
            yield start, min(self.stop, start + step)

    def floats(self, path: Path) -> np.ndarray:
        """The piece de-quantized: float32 in `shape`, rows in Hugging Face order."""
        rows = np.empty((self.stop - self.start, self.info.shape[-1]), dtype=np.float32)
        for start, stop in self.row_blocks():
            rows[start - self.start : stop - self.start] = dequantize_rows(path, self.info, start, stop)
        if self.row_order is not None:
            rows = rows[self.row_order]
        if self.shift:
            rows -= self.shift  # llama.cpp stored Gemma's norms as (1 + weight)
        return rows.reshape(self.shape)


def gguf_heads(header: GGUFHeader) -> tuple[int, int]:
    """(attention heads, key/value heads) a GGUF's metadata states."""
    file_arch = header.metadata.get("general.architecture")
    heads = int(header.metadata[f"{file_arch}.attention.head_count"])
    kv = header.metadata.get(f"{file_arch}.attention.head_count_kv")
    return heads, int(kv) if kv else heads


def pieces(header: GGUFHeader, arch: Architecture) -> Iterator[Piece]:
    """Every tensor of `header`'s file that our model loads, as our checkpoint's pieces, in
    file order (a stacked experts tensor: one piece per expert, in expert order)."""
    heads = gguf_heads(header) if arch.gguf_qk_interleaved else None
    for info in header.tensors:
        name = arch.from_gguf(info.name)
        if name is None:
            continue
        module, _, leaf = name.rpartition(".")
        rows = tensor_rows(info)
        if arch.is_expert(module) and "{e}" not in expert_pattern(module) and len(info.shape) > 1:
            experts = info.shape[0]
            per = rows // experts  # one expert's rows (1 for a bias [E, out])
            for e in range(experts):
                yield Piece(f"{one_expert(module, e)}.{leaf}", info, e * per, (e + 1) * per, info.shape[1:])
            continue
        order = _row_order(module, rows, heads) if heads is not None else None
        shift = arch.gguf_norm_shift if leaf == "weight" and module.endswith("norm") else 0.0
        yield Piece(name, info, 0, rows, info.shape, order, shift)


def _row_order(module: str, n_rows: int, heads: tuple[int, int]) -> np.ndarray | None:
    """For an architecture whose q/k rows llama.cpp stores per head as (pairs, 2) instead of
    (2, half) (Architecture.gguf_qk_interleaved): the index that restores the Hugging Face
    order, or None for other tensors."""
    n_heads = heads[0] if module.endswith("q_proj") else heads[1] if module.endswith("k_proj") else 0
    if not n_heads:
        return None
    index = np.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2)
    return index.transpose(0, 2, 1).reshape(-1)


def gguf_config_fields(header: GGUFHeader, arch: Architecture) -> dict[str, object]:
    """config.json fields `header`'s file states under the description's `gguf_config` keys
    ("{general.architecture}.{key}"), by their config name; the keys it lacks are left out;
    with those its family's reader states (weights/formats/gguf_config.py)."""
    prefix = f"{header.metadata.get('general.architecture')}."
    found = {ours: header.metadata.get(prefix + key) for key, ours in arch.gguf_config.items()}
    return {k: v for k, v in found.items() if v is not None} | llamacpp_fields(header)
