"""How a checkpoint may store tensors in another layout than our models hold them (`Packed`):
several of ours fused into one (interleaved or in halves), transposed, or as MXFP4 blocks
and scales. An architecture's description names which of its files' tensors are packed
(weights/formats/arch.py `TensorNames.packed`); the torch backend unpacks them as they load
(backends/torch/packed.py). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

_LAYOUTS = ("interleaved", "halves")


@dataclass(frozen=True)
class Packed:
    """A tensor a checkpoint stores in another layout than our model holds, turned into ours
    as it loads (backends/torch/packed.py). `into`: our tensors inside a layer it holds
    (weights [..., out, in], biases [..., out]; stacked experts lead with E); `layout`: how
    their output features sit when it holds several: "interleaved" (gpt-oss's gate and up:
    gate, up, gate, ..) or "halves" (transformers' Qwen3-MoE gate_up_proj: every gate row,
    then every up row); `transposed`: a weight stored [..., in, out]; `mxfp4`: "blocks"
    (MXFP4 values, two per byte: [..., out, in / 32, 16] uint8) or "scales" (each block of
    32's power-of-two exponent plus 127: [..., out, in / 32] uint8), the two stored parts of
    one weight. `dims`: the dimensions a stored tensor has (None: any)."""

    into: tuple[str, ...]
    transposed: bool = False
    mxfp4: str | None = None
    layout: str = "interleaved"
    dims: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in _LAYOUTS:
            raise ValueError(f"packed layout {self.layout!r} is not one of {_LAYOUTS}")

    def shapes(self, stored: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes of our tensors (one per `into`) in a stored tensor of shape `stored`;
        none for MXFP4 scales (their values are in the blocks' weights). ValueError for a
        shape that does not hold them (other dimensions than `dims`, features that do not
        divide among `into`)."""
        if self.dims is not None and len(stored) != self.dims:
            raise ValueError(f"of shape {tuple(stored)} has {len(stored)} dimensions, not {self.dims}")
        if self.mxfp4 == "scales":
            return ()
        shape = list(stored)
        if self.mxfp4 == "blocks":
            shape = [*shape[:-2], shape[-2] * shape[-1] * 2]  # [..., out, in]
        elif self.transposed:
            shape[-2:] = shape[-1], shape[-2]
        features = -1 if self.into[0].endswith(".bias") else -2
        if shape[features] % len(self.into):
            raise ValueError(
                f"of shape {tuple(stored)} has {shape[features]} output features, which do not divide in {len(self.into)}"
            )
        shape[features] //= len(self.into)
        return (tuple(shape),) * len(self.into)
