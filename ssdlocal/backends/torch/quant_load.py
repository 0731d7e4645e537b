"""Fill a meta-device model with quantized linears, one checkpoint tensor at a time.

Sources: a float checkpoint (each linear weight is read, quantized, and dropped) or a
quantized one (gguf_quant.py's cache: codes + scales, packed for the device as read).
Peak memory stays near the final model size: no float copy of the whole model and no
memory map whose touched pages would count twice. How many bytes the weights take once
loaded is weights/size.py's; what `--quantization auto` means for a path is a question
about files (weights/formats/quantized.py). Knows nothing about tensor
parallelism beyond a `shard` hook. The errors of a checkpoint that does not fit its model
(`names_mismatch`, `config_mismatch`) and the last move of the floats into it
(`assign_state`) serve the float loader (loader.py) too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from ssdlocal.backends.torch.gguf_quant import ensure_quantized
from ssdlocal.backends.torch.models.moe import stack_experts
from ssdlocal.backends.torch.packed import Unpacker
from ssdlocal.backends.torch.quant import QuantizedWeight, quantize
from ssdlocal.backends.torch.quant_experts import QuantStacked
from ssdlocal.backends.torch.quant_apply import QuantEmbedding, replace_linear, replace_module
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.quantization import DType, Quantization, can_quantize
from ssdlocal.weights.formats.arch import expert_pattern
from ssdlocal.weights.formats.archs import architecture
from ssdlocal.weights.formats.checkpoint import first_line
from ssdlocal.weights.formats.quantized import quant_info
from ssdlocal.weights.formats.safetensors import MemoryReleaser, SafetensorsReader

log = logging.getLogger(__name__)
_ONE_EXPERT = re.compile(r"(.*\.experts)\.(\d+)(\.\w+)")  # one expert's linear ("...experts.3.up_proj")

# shard(key, value) -> the rank's part of a tensor or QuantizedWeight (key: "...q_proj.weight")
Shard = Callable[[str, "Tensor | QuantizedWeight"], "Tensor | QuantizedWeight"]


def names_mismatch(
    ckpt, arch: str, missing: list[str], unexpected: list[str], extra: str = "unexpected"
) -> ModelLoadError:
    """The error for checkpoint `ckpt` whose tensor names are not the `arch` model's
    (`extra`: the word for the names it should not hold)."""
    return ModelLoadError(
        f"checkpoint {ckpt} does not match the {arch} architecture: "
        f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
        f"{extra} {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}",
        hint="the weights may be from another model or an incomplete download",
    )


def config_mismatch(ckpt, what: str) -> ModelLoadError:
    """The error for checkpoint `ckpt` holding a tensor of a shape its config.json does not
    give the model (`what`: which tensor, and how)."""
    return ModelLoadError(
        f"checkpoint {ckpt} does not match its config.json: {what}",
        hint="the config.json may belong to another model; use the model's own",
    )


def assign_state(model: nn.Module, state: dict[str, Tensor], ckpt) -> None:
    """`state` moved into `model` (load_state_dict, strict=False, assign: no copy); a tensor
    whose shape the config does not give it raises config_mismatch."""
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        sizes = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        raise config_mismatch(ckpt, (sizes or [first_line(exc)])[0][:300]) from exc


def quantized_checkpoint(path: Path, scheme: Quantization, dtype: DType | str, progress=None) -> Path:
    """The directory to read for `scheme`: a GGUF's cached conversion, else `path` itself.
    `dtype`: the scales' (a loader's spelling that names no DType, e.g. "auto": bfloat16)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        name = DType(dtype) if dtype in DType.choices() else DType.BFLOAT16
        return ensure_quantized(path, scheme, name, progress)
    return path


def load_quantized_weights(
    model: nn.Module,
    ckpt: Path,
    files: list[Path],
    scheme: Quantization,
    device: torch.device,
    dtype: torch.dtype,
    *,
    shard: Shard | None = None,
    on_read=None,
) -> None:
    """Fill meta-device `model` (possibly already shaped for a TP rank): the linears its
    architecture quantizes become QuantLinears, every other tensor is assigned in `dtype`
    on `device`. `on_read(nbytes)`: told the size of each tensor read (progress)."""
    if not Quantization(scheme).quantized:
        raise ValueError(f"not a quantization scheme: {scheme}")
    shard = shard or (lambda key, value: value)
    tied = model.args.tie_word_embeddings
    arch = architecture(model.args.arch)
    from_float = quant_info(ckpt) is None  # else the checkpoint stores lm_head's codes itself
    expected = set(model.state_dict())  # meta: names only
    linears = {n for n, _ in model.named_modules() if arch.quantized(n)}
    loader = _Filler(model, scheme, device, dtype, shard, ckpt)
    unpacker = Unpacker(arch, dtype)  # tensors stored packed (fused or MXFP4 experts) -> ours

    def place(key: str, tensor: Tensor) -> None:
        module, _, leaf = key.rpartition(".")
        one_expert = "{e}" in expert_pattern(module) and arch.quantized(module)  # stacked at the end
        if leaf in ("codes", "scales", "zeros"):  # a quantized checkpoint
            loader.add_part(module, leaf, tensor)
        elif leaf == "weight" and module in linears and tensor.ndim == 3 and can_quantize(tensor.shape, scheme):
            prefix, _, projection = module.rpartition(".")  # stacked experts: quantized one by one
            for e in range(tensor.shape[0]):
                loader.install(f"{prefix}.{e}.{projection}", quantize(tensor[e], scheme, dtype))
        elif (module in linears or one_expert) and leaf == "weight" and can_quantize(tensor.shape, scheme):
            loader.install(module, quantize(tensor, scheme, dtype))
        else:
            if (
                tied
                and from_float
                and key == "embed_tokens.weight"
                and "lm_head" in linears
                and can_quantize(tensor.shape, scheme)
            ):
                loader.install("lm_head", quantize(tensor, scheme, dtype))  # its own codes
            loader.floats[key] = shard(key, tensor).to(device=device, dtype=dtype)

    for file in files:
        with SafetensorsReader(file, on_read) as f:
            for name in f.keys():  # noqa: SIM118 - a reader, not a dict
                key = arch.from_checkpoint(name, tied)
                if key is None:
                    continue
                for ours, tensor in unpacker.take(key, f.read(name)).items():
                    place(ours, tensor)
    unpacker.finish(ckpt)
    loader.finish(expected, tied, ckpt)


class _Filler:
    """Collects a load: QuantLinears installed as their weights arrive, floats for the rest."""

    def __init__(self, model: nn.Module, scheme: Quantization, device, dtype, shard: Shard, ckpt: Path) -> None:
        self.model, self.scheme, self.device, self.dtype, self.shard = model, scheme, device, dtype, shard
        self.ckpt = ckpt
        self.floats: dict[str, Tensor] = {}
        self.parts: dict[str, dict[str, Tensor]] = {}
        self.installed: set[str] = set()
        self.experts: dict[str, dict[int, QuantizedWeight]] = {}  # stacked module -> expert -> its codes
        self.releaser = MemoryReleaser()

    def add_part(self, module: str, leaf: str, tensor: Tensor) -> None:
        parts = self.parts.setdefault(module, {})
        parts[leaf] = tensor
        codes = parts.get("codes")
        if codes is None or "scales" not in parts:
            return
        scheme = Quantization.INT8 if codes.dtype == torch.int8 else Quantization.INT4  # an embedding may differ
        if scheme is Quantization.INT4 and "zeros" not in parts:
            return
        zeros = parts.get("zeros")
        group = codes.shape[1] * 2 // zeros.shape[1] if zeros is not None else 0
        self.install(module, QuantizedWeight(scheme, codes, parts["scales"], zeros, group))
        del self.parts[module]

    def install(self, module: str, weight: QuantizedWeight) -> None:
        if weight.scales.dtype != self.dtype:  # a checkpoint stored for another dtype
            zeros = None if weight.zeros is None else weight.zeros.to(self.dtype)
            weight = QuantizedWeight(
                weight.scheme, weight.codes, weight.scales.to(self.dtype), zeros, weight.group_size
            )
        weight = self.shard(f"{module}.weight", weight)
        one = _ONE_EXPERT.fullmatch(module)
        if one is not None:  # one expert of a MoE layer: stacked with its siblings in `finish`
            self.experts.setdefault(one.group(1) + one.group(3), {})[int(one.group(2))] = weight
            self.releaser.processed(weight.nbytes)
            return
        old = self.model.get_submodule(module)
        if module == "embed_tokens":  # a quantized checkpoint's embedding: codes, looked up
            replace_module(self.model, module, QuantEmbedding(weight, dtype=self.dtype, device=self.device))
            self.installed.add(module)
            return
        self._check_shape(module, weight.shape)
        replace_linear(self.model, module, old, weight, None, self.dtype, self.device)
        self.installed.add(module)
        self.releaser.processed(weight.nbytes)

    def _check_shape(self, module: str, shape: tuple[int, ...]) -> None:
        """Refuse weights of `shape` for `module` unless the model (as this rank holds it) has that shape."""
        wanted = tuple(self.model.get_submodule(module).weight.shape)
        if tuple(shape) != wanted:
            raise config_mismatch(
                self.ckpt, f"{module}.weight is {tuple(shape)} in the checkpoint, {wanted} in a model of the config"
            )

    def _stack_experts(self) -> None:
        """Every MoE layer's experts, quantized one by one, as one QuantStacked (with their
        biases, stacked, when they have them)."""
        for module, parts in self.experts.items():
            order = sorted(parts)
            if order != list(range(len(order))):
                raise ModelLoadError(f"{module}: experts {sorted(set(range(max(order) + 1)) - set(order))} are missing")
            prefix, _, projection = module.rpartition(".")
            biases = [self.floats.pop(f"{prefix}.{e}.{projection}.bias", None) for e in order]
            bias = torch.stack(biases) if all(b is not None for b in biases) else None
            weights = [parts[e] for e in order]
            self._check_shape(module, (len(weights), *weights[0].shape))
            if any(w.shape != weights[0].shape for w in weights):
                raise ModelLoadError(
                    f"{module}: experts of different shapes in {self.ckpt}",
                    hint="the weights may be from another model or damaged; download the model again",
                )
            replace_module(self.model, module, QuantStacked(weights, bias, dtype=self.dtype, device=self.device))
            self.installed.add(module)
        self.experts.clear()

    def finish(self, expected: set[str], tied: bool, ckpt: Path) -> None:
        self._stack_experts()
        self.floats = stack_experts(self.floats)  # experts left in floats (not quantizable)
        for key in [k for k in self.floats if k.rpartition(".")[0] in self.installed]:
            module, _, leaf = key.rpartition(".")
            if leaf == "bias":  # QuantLinear adds it after any all_reduce
                self.model.get_submodule(module).bias = nn.Parameter(self.floats.pop(key), requires_grad=False)
        provided = set(self.floats) | {f"{m}.weight" for m in self.installed}
        provided |= {
            f"{m}.bias" for m in self.installed if getattr(self.model.get_submodule(m), "bias", None) is not None
        }
        if tied and "lm_head" not in self.installed:
            expected = expected - {"lm_head.weight"}
        missing, unexpected = sorted(expected - provided), sorted(provided - expected)
        if missing or unexpected or self.parts:
            unexpected += sorted(self.parts)
            raise names_mismatch(ckpt, self.model.args.arch, missing, unexpected, "unexpected or incomplete")
        assign_state(self.model, self.floats, ckpt)
        if tied and "lm_head" not in self.installed:
            self.model.lm_head.weight = self.model.embed_tokens.weight
        self.releaser.flush()
        log.info("%d linears as %s", len(self.installed), self.scheme)
