"""Load a GGUF file for the llama.cpp backend: checks, tokenizer, llama.cpp model.

Returns a LoadedGGUF with the fields the engine and drafters read from a torch
LoadedModel (tokenizer, args.vocab_size, args.max_position_embeddings, eos_token_ids,
device, dtype). The HF-like tokenizer is built by transformers from the GGUF's own
vocabulary once and cached; its ids are checked against llama.cpp's tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch

from ssdlocal.core.errors import ModelLoadError, UnsupportedArchitectureError
from ssdlocal.core.models import BackendName

log = logging.getLogger(__name__)

GGUF_HINT = (
    "the llama.cpp backend reads .gguf files; for a Hugging Face checkpoint directory "
    "use the torch backend (--backend torch)"
)
# What this process already did for a GGUF file as it is now (resolved path, size, mtime):
# its header checked, its tokenizer built. An engine reads each model's tokenizer for the
# pair check and again to load it, and each read checked the header (a pure-Python walk of
# 151k vocabulary strings, 0.8 s here): six walks and four tokenizer loads per start.
_CHECKED: set[str] = set()
_TOKENIZERS: dict[str, object] = {}
# Tokenizers loaded from the cache, by the digest of their files but the chat template: a
# draft of the target's family has the target's tokenizer files (0.76 s a load here).
_BY_FILES: dict[str, object] = {}
_TEMPLATE = "chat_template.jinja"
_REMEMBERED = 8  # entries each memo above keeps
_VOCAB_PROBE = "Hello world! def add(a, b):\n    return a + b  # 123 émoji 🙂 你好"


@dataclass(frozen=True)
class GGUFArgs:
    """What the engine reads from `args`: logits width and the longest context."""

    vocab_size: int
    max_position_embeddings: int
    arch: str
    hidden_size: int = 0  # hidden states this backend gives a drafter: none (Runner.keep_hidden refuses)


@dataclass
class LoadedGGUF:
    backend: ClassVar[BackendName] = BackendName.LLAMACPP  # what made it (backends.registry.make_runner)
    model: object  # llama_model pointer (owned by `lib`)
    lib: object  # LlamaLib (or a fake in tests)
    tokenizer: object  # transformers PreTrainedTokenizerBase
    args: GGUFArgs
    path: Path
    device: torch.device
    dtype: torch.dtype  # of the logits we return; the weights keep the GGUF's quantization
    eos_token_ids: tuple[int, ...]
    threads: int | None  # llama.cpp CPU threads (None: torch.get_num_threads() at each decode)
    n_gpu_layers: int
    main_gpu: int
    kv_bytes_per_token: int | None = None  # one token's k and v in every layer (f16), from the metadata
    batch_invariant: bool = False  # decode steps in alike call widths (backends/llamacpp/alike.py)

    def close(self) -> None:
        """Free the llama.cpp model (runners free their contexts first: they hold us)."""
        model, self.model = self.model, None
        if model is not None:
            self.lib.free_model(model)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone
            self.close()


def check_gguf_file(path: str | Path) -> Path:
    """The path as a readable GGUF file (magic bytes checked), or ModelLoadError."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist", GGUF_HINT)
    from ssdlocal.core.files import kind_of

    if (kind := kind_of(path)) is not None:
        raise ModelLoadError(f"{path} is {kind}, not a .gguf file", GGUF_HINT)
    if not path.is_file():
        raise ModelLoadError(f"{path} is a directory, not a .gguf file", GGUF_HINT)
    try:
        with path.open("rb") as f:
            head = f.read(24)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", "check the file's permissions") from exc
    if head[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header)", GGUF_HINT)
    if len(head) == 24 and struct.unpack("<I", head[4:8])[0] in (2, 3):
        stamp = _stamp(path)
        if stamp not in _CHECKED:
            from ssdlocal.weights.formats.gguf import GGUFHeader

            GGUFHeader.read(path)  # counts and lengths bounded by the file, before llama.cpp or transformers read it
            _CHECKED.add(stamp)
    return path


def _stamp(path: Path) -> str:
    """The file as it is now (core.measured.file_stamps: resolved path, size, mtime): a
    changed file is another key, checked and read again."""
    from ssdlocal.core.measured import file_stamps

    return json.dumps(file_stamps(path))


def gguf_architecture(path: Path) -> str:
    from ssdlocal.weights.formats.convert import gguf_metadata

    return str(gguf_metadata(path).get("architecture") or "unknown")


def parse_llama_device(device: str, lib) -> tuple[torch.device, int, int]:
    """ "cpu" / "cuda" / "cuda:N" -> (torch device, n_gpu_layers, main_gpu)."""
    if device == "cpu":
        return torch.device("cpu"), 0, 0
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not lib.supports_gpu():
            raise ModelLoadError(
                f"device {device!r} requested but this llama-cpp-python build has no GPU support",
                "reinstall with CUDA: CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall "
                "--no-cache-dir llama-cpp-python, or use --device cpu",
            )
        index = int(device[5:]) if device.startswith("cuda:") else 0
        if torch.cuda.is_available() and index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} does not exist ({torch.cuda.device_count()} GPUs)",
                "run `ssdlocal devices` to list devices",
            )
        return torch.device("cuda", index), 0x7FFFFFFF, index  # all layers on that GPU
    raise ModelLoadError(f"invalid device {device!r}", 'use "cpu", "cuda" or "cuda:N"')


def tokenizer_cache_dir(path: Path) -> Path:
    """Named by the GGUF file's content (as conversions are), not its name and mtime."""
    from ssdlocal.core.files import remembered_sha256
    from ssdlocal.core.paths import cache_dir

    root = cache_dir() / "gguf-tokenizers"
    key = remembered_sha256(path, root / "digests.json")
    return root / f"{path.name.removesuffix('.gguf')}-{key[:16]}"


def gguf_tokenizer(path: str | Path):
    """An HF tokenizer built from the GGUF's vocabulary (cached on disk after the first
    build; in this process, one object per file as it is: callers only read it)."""
    path = check_gguf_file(path)
    stamp = _stamp(path)
    if stamp not in _TOKENIZERS:
        _remember(_TOKENIZERS, stamp, _build_tokenizer(path))
    return _TOKENIZERS[stamp]


def _remember(memo: dict[str, object], key: str, value: object) -> None:
    """memo[key] = value, the oldest entry out beyond _REMEMBERED (a long-lived process
    that loads many models keeps a few)."""
    if len(memo) >= _REMEMBERED:
        memo.pop(next(iter(memo)))
    memo[key] = value


def _build_tokenizer(path: Path):
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return _load_cached(cached)
        except (OSError, ValueError, TypeError) as exc:  # a damaged cache entry: build it again
            log.warning("rebuilding the damaged tokenizer cache %s (%s)", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    except ImportError as exc:
        raise ModelLoadError("reading a GGUF tokenizer needs the `gguf` package", "pip install gguf") from exc
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        arch = gguf_architecture(path)
        raise UnsupportedArchitectureError(
            f"transformers cannot build a tokenizer from {path.name} (architecture {arch!r}): {exc}",
            "ssdlocal needs transformers' GGUF tokenizer support for this architecture "
            "(llama, qwen2, qwen3, gemma3, ...); upgrade transformers or use another model",
        ) from exc
    tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as exc:  # a read-only cache is not fatal
        log.debug("could not cache the GGUF tokenizer in %s: %s", cached, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _load_cached(cached: Path):
    """The tokenizer saved in `cached`. Where another of this process's tokenizers came
    from the same files (all but the chat template, which each model keeps its own), a
    copy of that one with this folder's template; the copy shares its vocabulary, which
    callers only read."""
    from transformers import AutoTokenizer

    digest = hashlib.sha256()
    template = None
    for file in sorted(p for p in cached.iterdir() if p.is_file()):
        data = file.read_bytes()
        if file.name == _TEMPLATE:
            template = data.decode("utf-8")
            data = b""  # present, its text apart
        digest.update(f"{file.name}\0{len(data)}\0".encode() + hashlib.sha256(data).digest())
    key = digest.hexdigest()
    known = _BY_FILES.get(key)
    if known is not None:
        twin = copy.copy(known)
        if template is not None:
            twin.chat_template = template  # type: ignore[attr-defined]
        return twin
    tok = AutoTokenizer.from_pretrained(cached, trust_remote_code=False)
    _remember(_BY_FILES, key, tok)
    return tok


def eos_ids_of(tokenizer) -> tuple[int, ...]:
    """The tokenizer's eos plus known end-of-turn tokens (same rule as GGUF conversion)."""
    from ssdlocal.weights.formats.convert import EXTRA_EOS

    vocab = tokenizer.get_vocab()
    found: list[int] = []
    for tid in (tokenizer.eos_token_id, *(vocab.get(t) for t in EXTRA_EOS)):
        if tid is not None and int(tid) not in found:
            found.append(int(tid))
    return tuple(found)


def check_vocab(lib, model, tokenizer, path: Path) -> int:
    """llama.cpp's vocabulary must give the HF tokenizer's ids; returns llama's n_vocab."""
    n_vocab = lib.n_vocab(model)
    top = max(tokenizer.get_vocab().values(), default=-1)
    if top >= n_vocab:
        raise ModelLoadError(
            f"vocabulary mismatch in {path.name}: the tokenizer uses ids up to {top}, "
            f"llama.cpp's vocabulary has {n_vocab} tokens",
            "the GGUF's tokenizer metadata looks damaged; fetch the file again",
        )
    ours = list(tokenizer.encode(_VOCAB_PROBE, add_special_tokens=False))
    theirs = lib.tokenize(model, _VOCAB_PROBE)
    if ours != theirs:
        raise ModelLoadError(
            f"vocabulary mismatch in {path.name}: transformers and llama.cpp tokenize a probe "
            f"text differently ({ours[:8]} vs {theirs[:8]})",
            "upgrade transformers and llama-cpp-python, or use the torch backend for this file",
        )
    return n_vocab


def load_gguf(
    path: str | Path, device: str = "cpu", threads: int | None = None, lib=None, batch_invariant: bool = False
) -> LoadedGGUF:
    """Load a GGUF file with llama.cpp (the KV cache comes with the runner's context).
    `batch_invariant`: its runners decode steps in alike call widths (ModelSpec)."""
    path = check_gguf_file(path)
    if lib is None:
        from ssdlocal.backends.llamacpp.lib import LlamaLib

        lib = LlamaLib(verbose=log.isEnabledFor(logging.DEBUG))
    dev, n_gpu_layers, main_gpu = parse_llama_device(device, lib)
    tokenizer = gguf_tokenizer(path)
    try:
        model = lib.load_model(str(path), n_gpu_layers, main_gpu)
    except ModelLoadError as exc:
        arch = gguf_architecture(path)
        raise UnsupportedArchitectureError(f"{exc.message} (architecture {arch!r})", exc.hint) from exc
    n_vocab = check_vocab(lib, model, tokenizer, path)
    arch = lib.meta(model, "general.architecture") or "unknown"
    args = GGUFArgs(n_vocab, lib.n_ctx_train(model), arch)
    log.info("loaded %s (%s) with llama.cpp on %s", path, arch, dev)
    return LoadedGGUF(
        model,
        lib,
        tokenizer,
        args,
        path,
        dev,
        torch.float32,
        eos_ids_of(tokenizer),
        threads,
        n_gpu_layers,
        main_gpu,
        kv_bytes_per_token(lib, model, arch),
        batch_invariant,
    )


def kv_bytes_per_token(lib, model, arch: str) -> int | None:
    """Bytes of one token's keys and values in every layer (llama.cpp's default f16 cache),
    from the model's metadata; None when it does not say."""

    def number(key: str) -> int | None:
        value = lib.meta(model, f"{arch}.{key}")
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    layers, heads, kv_heads = number("block_count"), number("attention.head_count"), number("attention.head_count_kv")
    width = number("attention.key_length") or (
        number("embedding_length") // heads if heads and number("embedding_length") else None
    )
    if not (layers and width):
        return None
    return 2 * 2 * layers * (kv_heads or heads) * width
