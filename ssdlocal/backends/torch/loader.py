"""Load a checkpoint (HF directory with safetensors, or a .gguf file) into our model (backends/torch/models).

Owns what this backend reads for a path (a GGUF's float conversion or quantized cache,
built on first use and checked against its digests: `resolve_checkpoint`, and ahead of a
load `prepare_weights`), the preflight against the weight files' headers and the memory,
and dtype/device placement. The files themselves (config, tokenizer, weight files,
checks, tensor names) are read through ssdlocal.weights.formats. Knows nothing about
decoding or speculation.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ssdlocal.backends.torch.models import CausalLM, ModelArgs, args_from_config, build
from ssdlocal.backends.torch.models.moe import stack_experts
from ssdlocal.backends.torch.packed import Unpacker
from ssdlocal.backends.torch.quant_load import (
    assign_state,
    load_quantized_weights,
    names_mismatch,
    quantized_checkpoint,
)
from ssdlocal.core.errors import (
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedArchitectureError,
)
from ssdlocal.core.files import check_digests, file_lock
from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import DType, Quantization
from ssdlocal.core.memory import human_bytes, is_oom, requested_bytes
from ssdlocal.weights.formats.arch import Architecture
from ssdlocal.weights.formats.archs import architecture
from ssdlocal.weights.formats.checkpoint import (
    checked,
    damaged_hint,
    first_line,
    is_cache_entry,
    load_hf_config,
    load_tokenizer,
    weight_files,
)
from ssdlocal.weights.formats.checks import check_against_weights
from ssdlocal.backends.torch.quant_speed import check_quant_speed
from ssdlocal.weights.formats.quantized import resolve_scheme
from ssdlocal.weights.formats.safetensors import DamagedFileError, SafetensorsReader

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype | None] = {  # the loader's spellings (DType's and aliases)
    "auto": None,  # the checkpoint's own
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    backend: ClassVar[BackendName] = BackendName.TORCH  # what made it (backends.registry.make_runner)
    model: CausalLM
    tokenizer: object  # transformers PreTrainedTokenizerBase
    args: ModelArgs
    hf_config: object
    path: Path
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    quantization: Quantization = Quantization.NONE  # the scheme the linears hold: none | int8 | int4


def parse_dtype(dtype: str | torch.dtype, hf_config=None) -> torch.dtype:
    """ "float32"/"bf16"/... -> torch dtype; "auto" takes the checkpoint's dtype (float32 if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {str(dtype)!r}", hint="use one of: float32, bfloat16, float16, auto")
    named = DTYPES[dtype]
    if named is not None:
        return named
    found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)  # "auto"
    if isinstance(found, str):
        found = DTYPES.get(found)
    return found if isinstance(found, torch.dtype) else torch.float32


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"invalid device {device!r}", hint='use "cpu", "cuda" or "cuda:N"') from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device {device!r} requested but CUDA is not available",
                hint="use --device cpu, or install a CUDA build of torch",
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} does not exist ({torch.cuda.device_count()} GPUs)",
                hint="run `ssdlocal devices` to list devices",
            )
        dev = torch.device("cuda", index)
    return dev


def resolve_checkpoint(
    path: str | Path, scheme: Quantization = Quantization.NONE, dtype: DType | str = DType.BFLOAT16
) -> Path:
    """Return an HF checkpoint directory for `path`, converting a .gguf file if needed:
    to a float checkpoint (scheme none) or straight to a quantized one (int8 | int4).
    A cached conversion is used only once its files match the digests recorded when it
    was written; one that does not is rebuilt (with a warning saying why)."""
    path = checked(path)
    if not path.is_file():
        if is_cache_entry(path) and (problem := check_digests(path)) is not None:
            raise ModelLoadError(
                f"{path} is a damaged ssdlocal cache entry: {problem}",
                hint=f"delete {path} and pass the .gguf file it was made from; ssdlocal converts it again",
            )
        return path

    def build() -> Path:
        if scheme != Quantization.NONE:
            return quantized_checkpoint(path, resolve_scheme(path, scheme), dtype)
        from ssdlocal.weights.formats.convert import ensure_converted

        return ensure_converted(path)

    ckpt = build()
    problem = check_digests(ckpt)
    if problem is None:
        return ckpt
    log.warning(
        "the cached conversion of %s in %s cannot be trusted: %s; converting it again", path.name, ckpt, problem
    )
    with file_lock(ckpt.with_name(ckpt.name + ".lock")):  # the builders' own lock
        if check_digests(ckpt) is not None:  # not rebuilt by another process meanwhile
            shutil.rmtree(ckpt, ignore_errors=True)
    return build()


def prepare_weights(
    path: str | Path, quantization: Quantization, dtype: DType, progress=None, *, floats: bool = True
) -> Path:
    """The checkpoint directory `load_model(path, ..., dtype, quantization)` will read,
    built now if it is not cached (reporting to `progress`, else to the installed display):
    a .gguf file's quantized cache when `quantization` resolves to int8/int4 for it, else
    its float conversion (`floats=False`: the file itself, nothing converted). A directory
    is itself once checked (`floats=False`: as given). Raises what `resolve_checkpoint` and
    `resolve_scheme` raise (ModelLoadError, UsageError)."""
    found = Path(path).expanduser()
    scheme = Quantization.NONE if quantization == Quantization.NONE else resolve_scheme(found, quantization)
    if scheme is not Quantization.NONE and found.is_file() and found.suffix.lower() == ".gguf":
        return quantized_checkpoint(found, scheme, dtype, progress)
    return resolve_checkpoint(found, Quantization.NONE, dtype) if floats else found


def declared_params(args: ModelArgs) -> int:
    """Parameters a model of `args` has, whatever its family: counted on a meta-device build
    (no memory), a tied lm_head once."""
    with torch.device("meta"):
        return sum(p.numel() for p in {id(p): p for p in build(args).parameters()}.values())


def preflight(
    ckpt: Path, args: ModelArgs, files: list[Path], scheme: Quantization, device: torch.device, dtype: torch.dtype
) -> None:
    """Before the model is built: the config's sizes against the weight files' headers,
    and the weights against the memory available (weights/formats/checks.py, weights/size.py)."""
    headers = {}
    try:
        for file in files:
            with SafetensorsReader(file) as f:
                headers[file.name] = {name: (f.dtype(name), f.shape(name)) for name in f.keys()}  # noqa: SIM118
    except (DamagedFileError, OSError) as exc:
        message = exc.message if isinstance(exc, DamagedFileError) else first_line(exc)
        raise ModelLoadError(f"cannot read the weights in {ckpt}: {message}", hint=damaged_hint(ckpt)) from exc
    check_against_weights(args, lambda: declared_params(args), architecture(args.arch), headers, ckpt)
    from ssdlocal.backends.torch.kvcache import check_room
    from ssdlocal.weights.size import weight_bytes

    need = weight_bytes(ckpt, scheme, str(dtype).removeprefix("torch."), device.type)
    check_room(need, device, f"weights of {ckpt.name} ({str(dtype).removeprefix('torch.')}, {scheme})")


def read_state_dict(
    files: list[Path],
    device: torch.device,
    dtype: torch.dtype,
    arch: Architecture,
    *,
    tied: bool = False,
    read=None,
    shard=None,
    on_read=None,
) -> dict[str, torch.Tensor]:
    """Our tensor names (arch.from_checkpoint) -> tensors already in the target dtype/device.

    `read(f, name, key)` picks what to keep of one tensor (default: all of it; tensor
    parallelism reads a slice). Tensors the architecture stores packed (fused or MXFP4
    experts: packed.Unpacker) are read whole and unpacked, and `shard(key, tensor)` picks
    what to keep of each of ours they hold. With `tied` embeddings a stored lm_head.weight
    is skipped. Experts stored one by one come back stacked (models.moe.stack_experts).
    `on_read(nbytes)`: told the size of each whole tensor read (progress).
    """
    state: dict[str, torch.Tensor] = {}
    unpacker = Unpacker(arch, dtype)

    def unpacked(key: str, whole: torch.Tensor, mapped: bool) -> None:
        for ours, tensor in unpacker.add(key, whole).items():
            kept = tensor if shard is None else shard(ours, tensor)
            state[ours] = kept.to(device=device, dtype=dtype, copy=mapped)  # mapped: see below

    for file in files:
        if read is None:  # whole tensors: plain reads, so no memory-mapped page stays resident
            with SafetensorsReader(file, on_read) as f:
                for name in f.keys():
                    if (key := arch.from_checkpoint(name, tied)) is None:
                        continue
                    if unpacker.claims(key):
                        unpacked(key, f.read(name), mapped=False)
                    else:
                        state[key] = f.read(name).to(device=device, dtype=dtype)  # own allocation
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:  # memory-mapped
            for name in f.keys():
                if (key := arch.from_checkpoint(name, tied)) is None:
                    continue
                if unpacker.claims(key):
                    unpacked(key, f.get_tensor(name), mapped=True)
                    continue
                # copy=True: never keep weights backed by the memory-mapped file. Such
                # pages are clean page cache that the kernel may drop under memory
                # pressure; every forward then page-faults the weights back in (seen:
                # AR at 0.6 instead of 7.7 tok/s until the pages happened to stay).
                state[key] = read(f, name, key).to(device=device, dtype=dtype, copy=True)
    unpacker.finish(files[0].parent if files else "")
    return stack_experts(state)  # experts stored one by one -> the stacks the model holds


def assign_weights(model: CausalLM, state: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Move `state` into the meta-device `model` (no copy); names must match exactly.

    Tied models expect no lm_head.weight (it is re-tied to the embedding here).
    Raises ModelLoadError naming missing / unexpected tensors.
    """
    args = model.args
    expected = set(model.state_dict()) - ({"lm_head.weight"} if args.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise names_mismatch(ckpt, args.arch, missing, unexpected)
    assign_state(model, state, ckpt)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def eos_ids(path: Path, hf_config, tokenizer) -> tuple[int, ...]:
    found: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)

    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError:
            log.warning("ignoring unreadable %s", gen)
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(getattr(hf_config, "text_config", None), "eos_token_id", None))  # a multimodal checkpoint's
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)


def load_model(
    path: str | Path,
    device: str = "cpu",
    dtype: DType | str = DType.FLOAT32,
    quantization: Quantization = Quantization.NONE,
) -> LoadedModel:
    """Load config, tokenizer and weights; the KV cache is left to the caller (setup_cache).

    quantization: none | int8 | int4 | auto (weights/formats/quantized.resolve_scheme); quantized linears
    are QuantLinears (quant.py), filled tensor by tensor.
    """
    scheme = resolve_scheme(path, quantization)
    ckpt = resolve_checkpoint(path, scheme, dtype)
    hf_config = load_hf_config(ckpt)
    args = args_from_config(hf_config)
    files = weight_files(ckpt)
    dev, torch_dtype = parse_device(device), parse_dtype(dtype, hf_config)
    tokenizer = load_tokenizer(ckpt)
    preflight(ckpt, args, files, scheme, dev, torch_dtype)
    check_quant_speed(args, scheme, dev, torch_dtype)  # a GPU whose int8/int4 kernel loses is told before loading
    on_read = _load_progress(path, files, scheme, torch_dtype)
    try:
        with torch.device("meta"):
            model = build(args)
        if scheme is not Quantization.NONE:
            load_quantized_weights(model, ckpt, files, scheme, dev, torch_dtype, on_read=on_read)
        else:
            state = read_state_dict(
                files, dev, torch_dtype, architecture(args.arch), tied=args.tie_word_embeddings, on_read=on_read
            )
            assign_weights(model, state, ckpt)
            del state
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if is_oom(exc):
            raise _oom(ckpt, dev, torch_dtype, exc) from exc
        raise
    except (SafetensorError, DamagedFileError, OSError) as exc:  # truncated or garbled weights
        raise ModelLoadError(f"cannot read the weights in {ckpt}: {first_line(exc)}", hint=damaged_hint(ckpt)) from exc
    if on_read is not None:
        on_read(None)  # the headers and skipped tensors count too
    model.requires_grad_(False).eval()
    log.info(
        "loaded %s (%s, %d layers) on %s as %s, weights %s", ckpt, args.arch, args.num_layers, dev, torch_dtype, scheme
    )
    return LoadedModel(
        model, tokenizer, args, hf_config, ckpt, dev, torch_dtype, eos_ids(ckpt, hf_config, tokenizer), scheme
    )


def _load_progress(path, files: list[Path], scheme: Quantization, dtype: torch.dtype):
    """on_read(nbytes) reporting "loading <model> (<weights>)" in bytes to the installed
    progress display (core.progress), or None when none is installed."""
    from ssdlocal.core.progress import model_label, reporter

    progress = reporter()
    if progress is None:
        return None
    weights = (
        scheme
        if scheme is not Quantization.NONE
        else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    )
    stage, total, done = f"loading {model_label(path)} ({weights})", sum(f.stat().st_size for f in files), 0
    progress(stage, 0, total)

    def on_read(nbytes: int | None) -> None:  # None: the load is done
        nonlocal done
        done = total if nbytes is None else min(done + nbytes, total)
        progress(stage, done, total)

    return on_read


def _oom(path: Path, device: torch.device, dtype: torch.dtype, exc: BaseException) -> OutOfMemoryError:
    size = requested_bytes(str(exc))
    failed = f" (an allocation of {human_bytes(size)} failed)" if size else ""
    return OutOfMemoryError(
        f"not enough memory on {device} to load {path} as {str(dtype).removeprefix('torch.')}{failed}",
        hint="use a smaller dtype (--dtype bfloat16), a smaller or quantized model, or another device",
    )


__all__ = ["LoadedModel", "load_model", "load_tokenizer", "UnsupportedArchitectureError"]
