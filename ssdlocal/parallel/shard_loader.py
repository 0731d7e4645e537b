"""Load one tensor-parallel rank's shard straight from safetensors slices.

Each rank reads only its slice of each split linear, as the architecture's description
says (weights/formats/arch.py): rows of the column-split ones (q/k/v, gate/up), columns of
the row-split ones (o_proj, down_proj), and the replicated embeddings, norms and lm_head
whole, so host memory per rank is about weights / TP + the replicated part, not the whole
model. Quantized weights are read one
tensor at a time, quantized whole and then split (shard_value), and so are tensors a
checkpoint stores packed (backends/torch/packed.py): unpacked whole, then split. The sharded module layout
comes from tp.apply_tensor_parallel on a meta-device model, so loading and sharding
cannot disagree. Reuses the loader's checks; knows nothing about processes.
"""

from __future__ import annotations

import logging

import torch

from ssdlocal.backends.torch.loader import (
    LoadedModel,
    assign_weights,
    eos_ids,
    parse_device,
    parse_dtype,
    preflight,
    read_state_dict,
    resolve_checkpoint,
)
from ssdlocal.backends.torch.models import args_from_config, build
from ssdlocal.backends.torch.quant import QuantizedWeight
from ssdlocal.backends.torch.quant_load import load_quantized_weights
from ssdlocal.core.config import ModelSpec
from ssdlocal.core.errors import ModelLoadError, OutOfMemoryError
from ssdlocal.core.quantization import Quantization
from ssdlocal.parallel.tp import apply_tensor_parallel, check_divisible
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import architecture
from ssdlocal.weights.formats.checkpoint import (
    load_hf_config,
    load_tokenizer,
    weight_files,
)
from ssdlocal.weights.formats.quantized import resolve_scheme

log = logging.getLogger(__name__)


def _read(f, name: str, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """The rank's part of checkpoint tensor `name`, split along `dim` (None: all of it)."""
    if dim is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    shape = part.get_shape()
    n = shape[dim] // world
    if n * world != shape[dim]:
        raise ModelLoadError(
            f"{name} has {shape[dim]} features, not divisible by {world} ranks",
            "use a number of target devices that divides the model's head counts",
        )
    return part[rank * n : (rank + 1) * n] if dim == 0 else part[:, rank * n : (rank + 1) * n]


def shard_value(arch: Architecture, key: str, value, rank: int, world: int):
    """The rank's part of a whole tensor or QuantizedWeight `key` (our name; quantized
    weights are quantized whole, then split: every rank then holds exactly TP=1's codes
    and scales)."""
    dim = arch.split_dim(key)
    if dim is None:
        return value
    n = value.shape[dim] // world
    if n * world != value.shape[dim]:
        raise ModelLoadError(
            f"{key} has {value.shape[dim]} features, not divisible by {world} ranks",
            "use a number of target devices that divides the model's head counts",
        )
    if isinstance(value, QuantizedWeight):
        if dim == 1 and value.scheme is Quantization.INT4 and n % value.group_size:
            raise ModelLoadError(
                f"{key}: {n} input features per rank split the int4 groups of {value.group_size}",
                "use fewer target devices, or --quantization int8",
            )
        return value.rows(rank * n, (rank + 1) * n) if dim == 0 else value.cols(rank * n, (rank + 1) * n)
    return value.narrow(dim, rank * n, n).contiguous()


def load_shard(spec: ModelSpec, device: str, rank: int, world: int, *, tokenizer: bool = True) -> LoadedModel:
    """The rank's shard of `spec` on `device`; `args` stays the full model's, `model.args` per rank."""
    scheme = resolve_scheme(spec.path, spec.quantization)
    ckpt = resolve_checkpoint(spec.path, scheme, spec.dtype)
    hf_config = load_hf_config(ckpt)
    args = args_from_config(hf_config)
    arch = architecture(args.arch)
    check_divisible(args.tensor_parallel_sizes, world)
    files = weight_files(ckpt)
    dev, dtype = parse_device(device), parse_dtype(spec.dtype, hf_config)
    tok = load_tokenizer(ckpt) if tokenizer else None
    preflight(ckpt, args, files, scheme, dev, dtype)
    with torch.device("meta"):
        model = build(args)
    apply_tensor_parallel(model, rank, world)  # shapes only: these are meta tensors
    try:
        if scheme is not Quantization.NONE:
            load_quantized_weights(
                model,
                ckpt,
                files,
                scheme,
                dev,
                dtype,
                shard=lambda key, value: shard_value(arch, key, value, rank, world),
            )
        else:
            state = read_state_dict(
                files,
                dev,
                dtype,
                arch,
                tied=args.tie_word_embeddings,
                read=lambda f, name, key: _read(f, name, arch.split_dim(key), rank, world),
                shard=lambda key, value: shard_value(arch, key, value, rank, world),  # packed: unpacked whole first
            )
            assign_weights(model, state, ckpt)
            del state
    except torch.OutOfMemoryError as exc:
        raise OutOfMemoryError(
            f"not enough memory on {dev} for rank {rank}'s shard of {ckpt}",
            hint="use more target devices, a smaller dtype (--dtype bfloat16), or a smaller model",
        ) from exc
    model.requires_grad_(False).eval()
    log.info("rank %d/%d: loaded its shard of %s on %s", rank, world, ckpt, dev)
    return LoadedModel(model, tok, args, hf_config, ckpt, dev, dtype, eos_ids(ckpt, hf_config, tok), scheme)
