"""Frozen configuration dataclasses: what the user asked for, validated on creation.

Facts discovered at run time (eos ids, cache sizes, devices actually used) live in
result objects elsewhere, never here. Invalid values raise UsageError with a hint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ssdlocal.core.choice import Choice
from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import (  # noqa: F401 - re-exported: the config's vocabulary
    DEFAULT_DTYPE,
    Draft,
    ModelDraft,
    ModelSpec,
    NgramDraft,
    MemorySettings,
    NoDraft,
    SuffixDraft,
    normalize_device,
)

SEED_MAX = 2**64 - 1  # seeds are 64-bit: 0 ..= SEED_MAX in every mode
MIN_TEMPERATURE = 1e-4  # below this logits / T overflows float32: use 0 (greedy)
MAX_K = 32  # draft tokens per round
ADAPTIVE_K_MAX = 12  # the most drafts an SD round chooses when K is not pinned
MAX_FAN_OUT_TOTAL = 256  # SSD branches per row (the sum of one fan-out list)
MAX_TOP_LOGPROBS = 20  # alternatives per emitted token (OpenAI's limit)


class Mode(Choice):
    """Decoding mode: plain autoregressive, synchronous SD, asynchronous SSD, or AUTO
    (the engine picks one of the three when it loads; see ssdlocal.engine.auto)."""

    AR = "ar"
    SD = "sd"
    SSD = "ssd"
    AUTO = "auto"


class Backup(Choice):
    """What serves an SSD cache miss (`--backup`): the draft just in time, prompt lookup,
    a suffix match over the row and the engine's memory, nothing, or AUTO (jit or n-gram,
    chosen each round by speculation.backup.BackupChooser). Rounds report the one used."""

    AUTO = "auto"
    JIT = "jit"
    NGRAM = "ngram"
    SUFFIX = "suffix"
    NONE = "none"


BACKUPS = Backup.choices()  # what --backup accepts


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy (argmax).

    max_new_tokens None: generate until end-of-sequence (or a stop string), bounded by
    the model's context minus the prompt. The CLI's default is None (options.py).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int | None = 128
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    # log-probabilities of each emitted token and of its `logprobs` likeliest alternatives
    # (core.logprobs); None: none computed
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise UsageError(
                f"temperature must be >= 0 and finite, got {self.temperature}",
                "use 0 for greedy decoding or a positive value such as 0.7",
            )
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise UsageError(
                f"temperature {self.temperature:g} is too small to sample with (at least {MIN_TEMPERATURE:g}, or 0)",
                "use --temperature 0 for greedy decoding (what a tiny temperature approaches)",
            )
        if not (isinstance(self.seed, int) and 0 <= self.seed <= SEED_MAX):
            raise UsageError(
                f"seed must be a whole number from 0 to {SEED_MAX} (64 bits), got {self.seed}",
                "use e.g. --seed 0",
            )
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0, got {self.top_k}", "use 0 to disable top-k")
        if not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}", "use 1.0 to disable top-p")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UsageError(
                f"max-new-tokens must be >= 1, got {self.max_new_tokens}",
                "ask for at least one new token",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise UsageError(
                f"logprobs must be 0..{MAX_TOP_LOGPROBS} alternatives per token, got {self.logprobs}",
                f"ask for at most {MAX_TOP_LOGPROBS}",
            )
        if any(s == "" for s in self.stop):
            raise UsageError("stop strings must not be empty", "drop the empty --stop value")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def warp(self) -> tuple:
        """What turning logits into probabilities depends on (core.sampling.logits_to_probs):
        rows with equal warps sample alike."""
        return ("greedy",) if self.greedy else (self.temperature, self.top_k, self.top_p)

    def stream_seed(self, offset: int) -> int:
        """Seed of a derived random stream (a drafter's): seed + offset, wrapped to 64 bits."""
        return (self.seed + offset) & SEED_MAX


def parse_fan_out(value: str | None) -> tuple[int, ...] | None:
    """CLI text -> fan-out tuple: "3,3,2,2,1" -> (3, 3, 2, 2, 1); None or "auto" -> None."""
    if value is None or value == "auto":
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise UsageError(f"cannot read fan-out {value!r}", "write comma-separated integers, e.g. 3,3,2,2,1") from None


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings: the mode, K, the draft (core.models.Draft) and SSD's knobs."""

    mode: Mode = Mode.AR
    k: int = 4  # drafts per round; with adaptive_k the most a round may have (SD only)
    draft: Draft = NoDraft()
    adaptive_k: bool = False  # SD: K (0 included) and the source chosen per round by measured cost
    memory: MemorySettings = MemorySettings()  # earlier prompts and answers, for suffix proposals
    # SSD / Saguaro (used by --mode ssd)
    fan_out: tuple[int, ...] | None = None  # None = auto
    fan_out_miss: tuple[int, ...] | None = None
    saguaro_c: float = 1.0
    backup: Backup = Backup.AUTO  # a string is parsed (unknown: UsageError)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise UsageError(f"k must be >= 1, got {self.k}", "use --k 4 (a typical lookahead)")
        if self.k > MAX_K:
            raise UsageError(
                f"k must be at most {MAX_K}, got {self.k}",
                "use --k 4 to 8: acceptance falls with every position, so long lookaheads waste work",
            )
        if self.mode not in (Mode.AR, Mode.AUTO) and isinstance(self.draft, NoDraft):
            raise UsageError(
                f"--mode {self.mode.value} needs a draft",
                "pass --draft PATH (a checkpoint with the target's tokenizer) or --draft ngram",
            )
        if not (0.0 < self.saguaro_c <= 1.0):
            raise UsageError(f"saguaro-c must be in (0, 1], got {self.saguaro_c}", "use 1.0 to disable")
        object.__setattr__(self, "backup", Backup.parse(self.backup, "backup"))
        for name, fan in (("fan-out", self.fan_out), ("fan-out-miss", self.fan_out_miss)):
            if fan is not None:
                if len(fan) != self.k + 1:
                    raise UsageError(
                        f"{name} needs K+1 = {self.k + 1} entries (one per accepted length), got {len(fan)}",
                        f"for K={self.k} write e.g. {','.join(['1'] * (self.k + 1))}",
                    )
                if any(f < 0 for f in fan):
                    raise UsageError(f"{name} entries must be >= 0", "use 0 to skip a position")
                if sum(fan) > MAX_FAN_OUT_TOTAL:
                    raise UsageError(
                        f"{name} {','.join(map(str, fan))} asks for {sum(fan)} branches per row; "
                        f"at most {MAX_FAN_OUT_TOTAL}",
                        "each branch costs the draft K tokens of work and cache per row; "
                        f"try e.g. {','.join(['2'] * (self.k + 1))}, or auto",
                    )


class GraphMode(Choice):
    """How a model's steps are captured and replayed: AUTO (CUDA graphs on CUDA devices,
    eager elsewhere), OFF (eager), TRACE (CUDA-graph semantics on any device: traced op
    graphs replayed over the tensors they captured). SSDLOCAL_GRAPHS overrides it in any
    process (backends.torch.graphs.resolve_mode)."""

    AUTO = "auto"
    OFF = "off"
    TRACE = "trace"


PREFIX_CACHE_TOKENS = 32768  # the prefix store's default size per model (at most a tenth of free memory)
PREFIX_CACHE_MAX = 1 << 24  # the most tokens one may ask for


def repeatable(spec: SpecConfig) -> SpecConfig:
    """`spec` with proposals that depend only on the prompt and the seed, so a seeded sample
    repeats: K pinned (the configured K; SpecConfig's default when it was chosen per round),
    suffix proposals from the row's own tokens only, none for a model draft; in SSD fixed
    fan-outs (an automatic one follows timing: the automatic planner's first plan, one
    candidate per accepted length; a miss list defaults to the hit list) and a backup
    that follows neither timing nor earlier requests (auto and suffix: jit)."""
    k = min(spec.k, SpecConfig.k) if spec.adaptive_k else spec.k
    draft = spec.draft
    if isinstance(draft, SuffixDraft):
        draft = replace(draft, use_memory=False)
    elif isinstance(draft, ModelDraft):
        draft = replace(draft, suffix=None)
    fits = lambda fan: fan if fan is not None and len(fan) == k + 1 else None  # noqa: E731
    fan_out = fits(spec.fan_out) or (1,) * (k + 1)
    fan_out_miss = fits(spec.fan_out_miss) or fan_out
    backup = Backup.JIT if spec.backup in (Backup.AUTO, Backup.SUFFIX) else spec.backup
    return replace(spec, k=k, adaptive_k=False, draft=draft, fan_out=fan_out, fan_out_miss=fan_out_miss, backup=backup)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs: the target and the speculation settings (which hold the
    draft, see core.models)."""

    target: ModelSpec
    spec: SpecConfig = field(default_factory=SpecConfig)
    pin_cpus: bool = True  # SSD with both models on CPU: give each process its own cores
    # Tensor-parallel target: one rank per device, rank 0 on target_devices[0] runs the
    # engine (ssdlocal/parallel). Empty or one device = the target alone on target.device.
    target_devices: tuple[str, ...] = ()
    # Captured forwards (GraphMode; a string is parsed, unknown: UsageError).
    # SSDLOCAL_GRAPHS=auto|off|trace overrides it in any process.
    graphs: GraphMode = GraphMode.AUTO
    # Prefix reuse: each model keeps the KV of up to this many tokens of earlier calls'
    # prompts and answers, and a new call feeds only what follows its longest stored
    # prefix. None = PREFIX_CACHE_TOKENS, at most a tenth of the memory free after loading;
    # 0 = off.
    prefix_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        tokens = self.prefix_cache_tokens
        if tokens is not None and not (isinstance(tokens, int) and 0 <= tokens <= PREFIX_CACHE_MAX):
            raise UsageError(
                f"prefix-cache-tokens must be a whole number from 0 to {PREFIX_CACHE_MAX}, got {tokens}",
                f"use e.g. --prefix-cache-tokens {PREFIX_CACHE_TOKENS}, or --no-prefix-cache to turn it off",
            )
        object.__setattr__(self, "graphs", GraphMode.parse(self.graphs, "graphs setting"))
        for dev in self.target_devices:
            ModelSpec(self.target.path, dev, self.target.dtype)  # same device rules
        object.__setattr__(self, "target_devices", tuple(normalize_device(d) for d in self.target_devices))
        if len(self.target_devices) > 1 and self.target_devices[0] != self.target.device:
            raise UsageError(
                f"target device {self.target.device!r} is not the first of the target devices "
                f"{', '.join(self.target_devices)}",
                "rank 0 of a tensor-parallel target runs on the first target device",
            )

    @property
    def draft_model(self) -> ModelSpec | None:
        """The draft model's spec when the draft is a model (spec.draft.model)."""
        return self.spec.draft.model
