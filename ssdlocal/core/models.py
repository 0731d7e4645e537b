"""What runs: a model (`ModelSpec`) and the draft that proposes tokens for the target (`Draft`).

A draft is one of a few typed descriptions, never a magic string:
- `NoDraft()`: nothing proposes (plain decoding);
- `NgramDraft(n_max, n_min)`: prompt lookup over the row's own tokens (point-mass proposals);
- `SuffixDraft(...)`: continuations of the longest matching suffix in the row's own tokens
  and in a bounded memory of the engine's earlier prompts and answers (point masses);
- `ModelDraft(model, suffix)`: a draft model, run in-process (SD) or in its own process
  (SSD); with `suffix` (the default) each SD round may take a row's suffix proposal instead
  when it predicts more accepted tokens (and skip the model's forwards when every row does).
Every kind answers `model` (its ModelSpec, or None) and `label` (one line for people), so
callers that only need those never branch on the kind; `word` is what `--draft` calls it
(None: a path names it). What builds a kind's drafter is ssdlocal.draft.factory's table
(BUILDERS, keyed by these types): this module knows no drafter. A new kind of draft is a
class here, listed in DRAFT_KINDS, its drafter module, and its row in BUILDERS. Invalid
values raise UsageError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ssdlocal.core.choice import Choice
from ssdlocal.core.errors import UsageError
from ssdlocal.core.quantization import DEFAULT_DTYPE, DType, Quantization

DTYPES = DType.choices()  # what --dtype accepts


class BackendName(Choice):
    """Which backend runs a model, and the facts about it that layers below the backends
    need (what its Backend does with it lives in ssdlocal.backends).

    TORCH: our native models; reads checkpoint directories, converts or quantizes a GGUF
    itself, applies --quantization int8/int4, runs tensor parallel. LLAMACPP:
    llama-cpp-python running a .gguf file as it is, in the file's own quantization.
    """

    TORCH = "torch"
    LLAMACPP = "llamacpp"

    @property
    def runs_gguf(self) -> bool:
        """Runs a GGUF file as it is (no checkpoint directory, no conversion)."""
        return self in _RUNS_GGUF

    @property
    def quantizes(self) -> bool:
        """Applies --quantization int8/int4 to the weights it loads."""
        return self not in _RUNS_GGUF

    @property
    def tensor_parallel(self) -> bool:
        """Can shard a target over several devices (ssdlocal.parallel)."""
        return self not in _RUNS_GGUF


_RUNS_GGUF = frozenset({BackendName.LLAMACPP})
BACKENDS = BackendName.choices()


def normalize_device(device: str) -> str:
    """One spelling per device, so devices can be compared as strings: "cuda" (torch's
    default CUDA device, index 0 in a process that sets none) -> "cuda:0"; "cuda:01" ->
    "cuda:1". Other names are returned as they are."""
    if device == "cuda":
        return "cuda:0"
    if device.startswith("cuda:") and device[5:].isdigit():
        return f"cuda:{int(device[5:])}"
    return device


@dataclass(frozen=True)
class ModelSpec:
    """Where a model lives and how to run it."""

    path: str
    device: str = "cpu"
    dtype: DType = DEFAULT_DTYPE  # a string is parsed (unknown: UsageError)
    backend: BackendName = BackendName.TORCH  # a string is parsed (unknown: UsageError)
    # Weights of the torch backend: none | int8 | int4 | auto (a GGUF's own class; see
    # core/quantization.py). llama.cpp always runs a GGUF in its own quantization. A string
    # is parsed (unknown: UsageError).
    quantization: Quantization = Quantization.NONE
    # llama.cpp on a CPU: decode steps only in call widths whose logits llama.cpp computes
    # alike (a lone token padded to two, K+1 tokens split), each call from an empty cache
    # (no prefix store), so greedy AR, SD and SSD of one request agree bit for bit; steps
    # cost more (backends/llamacpp/alike.py).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", BackendName.parse(self.backend, "backend"))
        object.__setattr__(self, "quantization", Quantization.parse(self.quantization, "quantization"))
        object.__setattr__(self, "dtype", DType.parse(self.dtype, "dtype"))
        if not self.backend.quantizes and self.quantization.quantized:
            raise UsageError(
                f"--quantization {self.quantization} applies to the torch backend only",
                "llama.cpp runs a GGUF in its own quantization: drop --quantization, "
                "or use the torch backend (--target-backend torch, or auto, which picks it "
                "for int8/int4)",
            )
        dev = self.device
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise UsageError(f"unknown device {dev!r}", "use cpu, cuda or cuda:N")
        object.__setattr__(self, "device", normalize_device(dev))  # compared as strings later
        if self.batch_invariant and (self.backend is not BackendName.LLAMACPP or self.device != "cpu"):
            raise UsageError(
                "--batch-invariant applies to the llama.cpp backend on a CPU",
                "run a .gguf target on the CPU with llama-cpp-python installed (--target-backend "
                "llamacpp --target-device cpu), or drop --batch-invariant",
            )


@dataclass(frozen=True)
class NoDraft:
    """No proposals: plain autoregressive decoding."""

    ssd: ClassVar[bool] = True  # every kind drafts in SSD too unless it says not (HeadDraft)
    kind: ClassVar[str] = "none"
    model: ClassVar[None] = None
    label: ClassVar[str] = "none"
    word: ClassVar[str | None] = None


@dataclass(frozen=True)
class NgramDraft:
    """Prompt lookup: the continuation of the longest n-gram (n_max down to n_min) that
    ends the row and occurred earlier in it. Deterministic: verified as point masses."""

    n_max: int = 3
    n_min: int = 1
    ssd: ClassVar[bool] = True
    kind: ClassVar[str] = "ngram"
    model: ClassVar[None] = None
    label: ClassVar[str] = "n-gram (prompt lookup)"
    word: ClassVar[str] = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise UsageError(
                f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}",
                "use the defaults (n_min 1, n_max 3)",
            )


@dataclass(frozen=True)
class SuffixDraft:
    """Suffix-match proposals over the row's tokens and the engine's memory of earlier
    prompts and answers (MemorySettings). `min_confidence`: a proposal stops where the share
    of matching history that agrees with it falls below this."""

    min_confidence: float = 0.3
    use_memory: bool = True  # False: the row's own tokens only (proposals repeat for a seed)
    ssd: ClassVar[bool] = True
    kind: ClassVar[str] = "suffix"
    model: ClassVar[None] = None
    label: ClassVar[str] = "suffix (prompt and memory)"
    word: ClassVar[str] = "suffix"

    def __post_init__(self) -> None:
        if not 0.0 < self.min_confidence <= 1.0:
            raise UsageError(f"min confidence must be in (0, 1], got {self.min_confidence}", "use 0.3")


@dataclass(frozen=True)
class MemorySettings:
    """The engine's memory of earlier prompts and answers (suffix proposals, the SSD suffix
    backup): at most `max_sequences` sequences and `max_tokens` tokens (0: none), kept for
    the engine's life; with `persist`, also in a file per target model under the cache
    directory (off by default)."""

    max_sequences: int = 256
    max_tokens: int = 200_000
    persist: bool = False

    def __post_init__(self) -> None:
        if self.max_sequences < 1 or self.max_tokens < 0:
            raise UsageError(
                f"the suffix memory needs max_sequences >= 1 and max_tokens >= 0, got "
                f"{self.max_sequences}, {self.max_tokens}",
                "use the defaults (256, 200000)",
            )


@dataclass(frozen=True)
class ModelDraft:
    """A draft model with the target's tokenizer (checked when the engine loads); `suffix`:
    SD rounds may use suffix proposals instead (None: the model only)."""

    model: ModelSpec
    suffix: SuffixDraft | None = SuffixDraft()
    ssd: ClassVar[bool] = True
    kind: ClassVar[str] = "model"
    word: ClassVar[None] = None

    @property
    def label(self) -> str:
        return self.model.path


@dataclass(frozen=True)
class HeadDraft:
    """A draft head (an EAGLE-3 checkpoint or Gemma 4 assistant directory) that drafts from
    the target's hidden states, run beside the target on its device; SD only (a head needs
    the hidden state of the token it continues, which exists once the target has verified it)."""

    path: str
    head: str = "eagle3"  # the kind (weights.formats.archs.HEADS)
    kind: ClassVar[str] = "head"
    model: ClassVar[None] = None
    word: ClassVar[None] = None
    ssd: ClassVar[bool] = False  # drafts in SD only

    @property
    def label(self) -> str:
        return f"{self.head} head {self.path}"


Draft = NoDraft | NgramDraft | SuffixDraft | ModelDraft | HeadDraft
DRAFT_KINDS = (NoDraft, NgramDraft, SuffixDraft, ModelDraft, HeadDraft)
