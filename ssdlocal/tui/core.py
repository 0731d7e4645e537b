"""UI-free core of the chat TUI: settings, slash commands, conversation, token colouring.

Everything here is plain Python over the engine's interface (EngineLike) and events;
it never imports Textual, so it is tested directly and reused by the race screen.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import MAX_K, EngineConfig, Mode, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import Event, TokenOrigin

MODES = (Mode.AR, Mode.SD, Mode.SSD)


class EngineLike(Protocol):
    """What the TUI needs from an engine (ssdlocal.engine.Engine, or a scripted fake)."""

    config: EngineConfig
    tokenizer: Any

    def generate(
        self,
        prompts,
        params: SamplingParams,
        *,
        chat: bool = False,
        spec: SpecConfig | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[Event]: ...
    def encode(self, prompt: str, chat: bool) -> list[int]: ...
    def max_prompt_tokens(self, max_new_tokens: int, spec: SpecConfig | None = None) -> int: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


def claim_engine_device(engine: EngineLike) -> None:
    """Make the engine's target device current in the calling thread (CUDA's current
    device is per thread: every worker thread that runs the engine calls this first, or
    implicit work lands on cuda:0); a no-op on the CPU."""
    from ssdlocal.backends.registry import claim_device

    claim_device(engine.config.target.device)


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ChatSettings:
    """What the user can change between turns: the per-call speculation settings (the
    draft model itself is fixed by the loaded engine) and the sampling parameters.
    Both are validated by their own classes; only the chat's K range is checked here."""

    spec: SpecConfig
    sampling: SamplingParams = SamplingParams(max_new_tokens=256)

    def __post_init__(self) -> None:
        if not 1 <= self.spec.k <= MAX_K:
            raise UsageError(f"K must be between 1 and {MAX_K}, got {self.spec.k}", "try K=4")

    @property
    def mode(self) -> Mode:
        return self.spec.mode

    @property
    def k(self) -> int:
        return self.spec.k

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def max_new_tokens(self) -> int | None:
        return self.sampling.max_new_tokens

    def with_spec(self, **changes: Any) -> ChatSettings:
        return replace(self, spec=replace(self.spec, **changes))

    def with_sampling(self, **changes: Any) -> ChatSettings:
        return replace(self, sampling=replace(self.sampling, **changes))

    def with_mode(self, mode: Mode) -> ChatSettings:
        return self.with_spec(mode=mode)

    def next_mode(self) -> ChatSettings:
        """Cycle AR -> SD -> SSD -> AR (AR only when no draft is loaded)."""
        if self.spec.draft.kind == "none":
            raise UsageError(
                "no draft model is loaded, so only AR is available",
                "restart with --draft PATH (or --draft ngram) to use SD or SSD",
            )
        now = MODES.index(self.mode) if self.mode in MODES else -1  # AUTO: start the cycle
        return self.with_mode(MODES[(now + 1) % len(MODES)])

    def with_k(self, k: int) -> ChatSettings:
        """A new K, pinned (no longer chosen per round); fan-out lists that no longer have K+1
        entries fall back to auto."""
        fits = lambda fan: fan if fan is not None and len(fan) == k + 1 else None  # noqa: E731
        return self.with_spec(
            k=k, adaptive_k=False, fan_out=fits(self.spec.fan_out), fan_out_miss=fits(self.spec.fan_out_miss)
        )

    def with_temperature(self, temperature: float) -> ChatSettings:
        return self.with_sampling(temperature=round(max(0.0, temperature), 3))

    def describe(self, compact: bool = False) -> str:
        """`SD · K≤12 per round · T=0 · max 40`; compact (a narrow status line): `SD K≤12 T=0 max 40`."""
        fan = "auto" if self.spec.fan_out is None else ",".join(map(str, self.spec.fan_out))
        parts = [self.mode.value.upper()]
        adaptive = self.spec.adaptive_k and self.mode is Mode.SD
        if self.mode is not Mode.AR:
            parts.append(
                f"K≤{self.k}" + (" per round" if adaptive and not compact else "") if adaptive else f"K={self.k}"
            )
        if self.mode is Mode.SSD:
            parts.append(f"F={fan}")
        parts.append(f"T={self.temperature:g}")
        parts.append(
            ("to EOS" if compact else "max to EOS") if self.max_new_tokens is None else f"max {self.max_new_tokens}"
        )
        return (" " if compact else " · ").join(parts)


# --------------------------------------------------------------------------- commands
COMMANDS_HELP = (
    ("/mode ar|sd|ssd", "decoding mode (F2 cycles)"),
    ("/k N", "draft tokens per round K (F3 / F4)"),
    ("/fanout 3,3,2,2,1|auto", "SSD fan-out per accepted length (K+1 entries)"),
    ("/temp X", "temperature, 0 = greedy (F5 / F6)"),
    ("/max N|eos", "max new tokens per answer (eos: until end-of-sequence)"),
    ("/seed N", "sampling seed"),
    ("/colors", "toggle token colours by origin (F8)"),
    ("/copy", "copy the last answer (Ctrl+Y)"),
    ("/stop", "stop the generation (Esc)"),
    ("/clear", "clear the conversation (Ctrl+L)"),
    ("/help", "this help (F1)"),
)
ACTIONS = ("colors", "copy", "stop", "clear", "help")


@dataclass(frozen=True)
class CommandResult:
    """Outcome of a slash command: new settings, or an action name for the UI."""

    settings: ChatSettings | None = None
    action: str | None = None


def run_command(line: str, settings: ChatSettings) -> CommandResult:
    """Apply `/name arg` to the settings. Raises UsageError (with a hint) on bad input."""
    name, _, arg = line.strip().lstrip("/").partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ACTIONS:
        return CommandResult(action=name)
    if name in ("mode", "m"):
        try:
            return CommandResult(settings.with_mode(Mode(arg.lower())))
        except ValueError:
            raise UsageError(f"unknown mode {arg!r}", "use /mode ar, /mode sd or /mode ssd") from None
    if name == "k":
        return CommandResult(settings.with_k(_int(arg, "/k 4")))
    if name in ("fanout", "fan-out", "f"):
        if arg.lower() in ("", "auto"):
            return CommandResult(settings.with_spec(fan_out=None))
        try:
            fan = tuple(int(x) for x in arg.split(","))
        except ValueError:
            raise UsageError(f"cannot read fan-out {arg!r}", "write e.g. /fanout 3,3,2,2,1") from None
        return CommandResult(settings.with_spec(fan_out=fan))
    if name in ("temp", "temperature", "t"):
        try:
            value = float(arg)
        except ValueError:
            raise UsageError(f"cannot read temperature {arg!r}", "write e.g. /temp 0.7") from None
        return CommandResult(settings.with_sampling(temperature=value))
    if name in ("max", "max-new-tokens"):
        cap = None if arg.strip().lower() in ("eos", "none", "off") else _int(arg, "/max 256 or /max eos")
        return CommandResult(settings.with_sampling(max_new_tokens=cap))
    if name == "seed":
        return CommandResult(settings.with_sampling(seed=_int(arg, "/seed 0")))
    raise UsageError(f"unknown command /{name}", "type /help for the list of commands")


def _int(arg: str, example: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise UsageError(f"expected a whole number, got {arg!r}", f"write e.g. {example}") from None


# --------------------------------------------------------------------------- conversation
@dataclass
class Conversation:
    """The message history; builds the token ids of the next turn via the chat template."""

    system: str | None = None
    messages: list[dict[str, str]] | None = None

    def __post_init__(self) -> None:
        self.messages = list(self.messages or [])

    def history(self, user_text: str | None = None) -> list[dict[str, str]]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        if user_text is not None:
            msgs.append({"role": "user", "content": user_text})
        return msgs

    def prompt_ids(self, tokenizer, user_text: str) -> list[int]:
        """Token ids of the whole conversation plus the new user turn, ready to generate."""
        return self._render(tokenizer, self.history(user_text))

    def fit_prompt_ids(self, tokenizer, user_text: str, budget: int) -> tuple[list[int], int]:
        """(prompt ids of at most `budget` tokens, turns forgotten now): the oldest
        user/assistant turns are dropped from the history until the rest fits the models'
        context. UsageError when the new message alone (with the system prompt) does not fit."""
        dropped = 0
        while True:
            ids = self.prompt_ids(tokenizer, user_text)
            if len(ids) <= budget:
                return ids, dropped
            if not self.messages:
                raise UsageError(
                    f"this message needs {len(ids)} tokens, but only {max(budget, 0)} fit in the "
                    "models' context next to the answer's token budget",
                    "shorten the message, or lower /max to leave more room for the prompt",
                )
            del self.messages[:2]  # the oldest user turn and its answer
            dropped += 1

    def _render(self, tokenizer, msgs: list[dict[str, str]]) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:  # base model: a plain transcript the model can continue
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs) + "Assistant:"
        return list(tokenizer.encode(text, add_special_tokens=False))

    def add_turn(self, user_text: str, answer: str) -> None:
        self.messages.append({"role": "user", "content": user_text})
        self.messages.append({"role": "assistant", "content": answer})

    def clear(self) -> None:
        self.messages.clear()


# --------------------------------------------------------------------------- colouring
Piece = tuple[str, str]  # (text, TokenOrigin value)


class OriginSplitter:
    """Splits each TokensEvent's text delta into pieces coloured by token origin.

    Inside one event origins form at most a few runs (accepted drafts, then the bonus
    token). The text up to each run boundary is found by decoding the generated prefix;
    the event's text delta itself is always shown exactly as the engine streamed it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.chars = 0  # characters streamed so far

    def split(self, token_ids: Sequence[int], origins: Sequence[str], text: str) -> list[Piece]:
        origins = list(origins) or [TokenOrigin.TARGET.value] * len(token_ids)
        start, end = self.chars, self.chars + len(text)
        runs: list[tuple[int, str]] = []  # (index after the run's last token, origin)
        for i, origin in enumerate(origins):
            origin = getattr(origin, "value", origin)
            if runs and runs[-1][1] == origin:
                runs[-1] = (i + 1, origin)
            else:
                runs.append((i + 1, origin))
        pieces: list[Piece] = []
        cut = start
        for n, (stop, origin) in enumerate(runs):
            if n == len(runs) - 1:
                boundary = end
            else:
                prefix = self.tokenizer.decode(self.ids + list(token_ids[:stop]), skip_special_tokens=True)
                boundary = min(max(len(prefix.rstrip("\ufffd")), cut), end)
            if boundary > cut:
                pieces.append((text[cut - start : boundary - start], origin))
            cut = boundary
        self.ids.extend(token_ids)
        self.chars = end
        return pieces


# --------------------------------------------------------------------------- header
def _name(path: str | None) -> str:
    return Path(path).name or path if path else "none"


def _weights(spec) -> str:
    """`int4 (Q4_K_M)`: what the weights run as (not only the activation dtype)."""
    from ssdlocal.weights.describe import weights_format

    fmt, file_type = weights_format(spec.path, spec.backend, spec.quantization, spec.dtype)
    return f"{fmt} ({file_type})" if file_type and not spec.backend.runs_gguf else fmt


def describe_pair(config: EngineConfig) -> tuple[str, str]:
    """Two header lines that fit 80 columns: the model pair (short names), and where each
    runs with what its weights really are (`target cpu int4 (Q4_K_M) · draft ...`)."""
    from ssdlocal.core.progress import model_label

    draft = config.spec.draft
    pair = f"{model_label(config.target.path)} + " + (
        model_label(draft.model.path) if draft.model else f"{draft.label} draft"
    )
    t = config.target
    where = [f"target {t.device} {_weights(t)}"]
    if config.draft_model is not None:
        d = config.draft_model
        where.append(f"draft {d.device} {_weights(d)}, own process in SSD")
    elif draft.kind != "none":
        where.append(f"{draft.label} draft on cpu")
    return pair, " · ".join(where)


def describe_details(config: EngineConfig, choice=None) -> list[tuple[str, str]]:
    """(heading, text) pairs for the chat's "why" view: the mode and its whole reason, each
    model's weights and file, where it runs, and the CPU split SSD would use."""
    from ssdlocal.weights.describe import spec_label

    rows = []
    if choice is not None:
        rows.append((f"mode {choice.mode.value}", choice.reason))
    t = config.target
    rows.append(("target", f"{spec_label(t)}; {t.device}, {t.dtype} activations, this process"))
    draft = config.spec.draft
    if config.draft_model is not None:
        d = config.draft_model
        rows.append(
            (
                "draft",
                f"{spec_label(d)}; {d.device}, {d.dtype} activations; in this process "
                "for SD, in a process of its own for SSD",
            )
        )
        if t.device == "cpu" and d.device == "cpu" and config.pin_cpus:
            from ssdlocal.placement.cpus import split_cpus

            plan = split_cpus()
            if plan is not None:
                rows.append(("SSD cores", f"target {_cpus(plan.target_cpus)} | draft {_cpus(plan.draft_cpus)}"))
    elif draft.kind != "none":
        rows.append(("draft", f"{draft.label}: proposals from tokens, no model (costs nothing to run)"))
    return rows


def _cpus(cpus: Sequence[int]) -> str:
    cpus = list(cpus)
    if len(cpus) > 2 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def progress_line(stage: str, done: float, total: float | None, started: float, now: float | None = None) -> str:
    """`loading qwen2.5-coder-1.5b (int4): 45% · about 12 s left` for a screen's status."""
    import time

    now = time.monotonic() if now is None else now
    if not total:
        return f"{stage}…"
    fraction = min(done / total, 1.0)
    text = f"{stage}: {fraction:.0%}"
    elapsed = now - started
    if 0 < fraction < 1 and elapsed > 1:
        text += f" · about {elapsed * (1 - fraction) / fraction:.0f} s left"
    return text


def error_text(exc: BaseException) -> tuple[str, str]:
    """(message, hint) for any failure in background work; SSDLocalError keeps its own."""
    message = getattr(exc, "message", None)
    if message is not None:
        return message, getattr(exc, "hint", "")
    text = str(exc).splitlines()[0] if str(exc) else ""
    from ssdlocal.core.memory import oom_error

    oom = oom_error(exc, hint="use a smaller /max or /k, /clear the history, --dtype bfloat16, or another device")
    if oom is not None:
        return oom.message, oom.hint
    return (
        f"unexpected {type(exc).__name__}: {text}".rstrip(": "),
        "this is a bug; rerun with --verbose and report it",
    )
