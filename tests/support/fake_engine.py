"""A scripted fake engine for the TUI tests: same interface as Engine, no model.

It yields fixed TokensEvent / RoundEvent / DoneEvent sequences per mode (the same
answer in every mode, like an exact engine at T=0), with timings from a virtual clock
so stats and replays are deterministic. Optional real delays make "stop" testable.
UI-free: no Textual import.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Iterator
from typing import Any, ClassVar

from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from ssdlocal.core.errors import SSDLocalError, UsageError
from ssdlocal.core.events import (
    DoneEvent,
    Event,
    LazySnapshot,
    ModeEvent,
    Output,
    PrefillEvent,
    PrefillProgress,
    RoundEvent,
    SsdRound,
    TokenOrigin,
    TokensEvent,
)
from ssdlocal.core.sequence import FinishReason
from ssdlocal.core.stats import RunStats
from support.drafts import draft_of

_TEXT = (
    "Speculative decoding lets a small draft model propose several tokens that the large "
    "target model checks in one pass. Accepted tokens are free; a rejected one is replaced "
    "by a bonus token from the target, so the output is exactly what the target alone "
    "would write. SSD goes further: while the target verifies, the draft already prepares "
    "the next round for the most likely outcomes, and a cache hit hides the drafting time."
)
WORDS = _TEXT.split()
ACCEPT_PATTERN = (4, 2, 4, 0, 3, 4, 1, 4)  # accepted drafts per round (capped at K)
HIT_PATTERN = (True, True, False, True, True, True, False, True)
ROUND_S = {Mode.AR: 0.050, Mode.SD: 0.085, Mode.SSD: 0.055}  # virtual seconds per round
PREFILL_S = 0.120


class FakeClock:
    """A thread-safe virtual clock the fake engine advances instead of sleeping."""

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class FakeTokenizer:
    """Word-level tokenizer: id i <-> WORDS[i - 3]; ids 0..2 are special."""

    chat_template = "{fake chatml}"
    eos_token_id = 0
    SPECIAL: ClassVar[dict[int, str]] = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}

    def __init__(self) -> None:
        self._vocab = {w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}
        self._words = {i: w for w, i in self._vocab.items()}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<|im_start|>{m['role']} {m['content']} <|im_end|> " for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant "
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        inverse = {v: k for k, v in self.SPECIAL.items()}
        return [inverse.get(w, self._vocab.get(w, 3 + hash(w) % 50)) for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            if i in self.SPECIAL:
                if not skip_special_tokens:
                    out.append(self.SPECIAL[i] + " ")
            else:
                out.append(self._words.get(int(i), "?") + " ")
        return "".join(out)


def fake_config(mode: Mode = Mode.SSD, draft: str | None = "/models/tiny-draft") -> EngineConfig:
    spec = SpecConfig(mode=mode, k=4, draft=draft_of(draft))
    return EngineConfig(target=ModelSpec("/models/tiny-target", "cpu", "float32"), spec=spec, pin_cpus=False)


class FakeEngine:
    """Scripted Engine stand-in. `delay_s` sleeps (real time) per round; `fail_after`
    raises `error` after that many rounds (e.g. a DraftWorkerError); `hold_after`
    blocks after that many rounds until cancel() (a generation that is surely mid-way)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        answer: list[str] | None = None,
        delay_s: float = 0.0,
        clock: FakeClock | None = None,
        fail_after: int | None = None,
        error: Exception | None = None,
        hold_after: int | None = None,
        context: int = 1 << 20,
    ) -> None:
        self.config = config or fake_config()
        self.mode_event_at: int | None = None  # yield a ModeEvent after this round
        self.choice = None  # an engine/auto.ModeChoice when a test sets one
        self.tokenizer = FakeTokenizer()
        self.answer = [self.tokenizer._vocab[w] for w in (answer or WORDS)]
        self.delay_s = delay_s
        self.clock = clock or FakeClock()
        self.fail_after = fail_after
        self.error = error or SSDLocalError(
            "the draft worker process died (exit code -9)",
            "it will be restarted on the next request",
        )
        self.hold_after = hold_after  # after this many rounds, wait (<= 10 s) for cancel()
        self.context = context  # positions the "models" hold: longer prompts are refused
        self.gate: threading.Event | None = None  # generate waits for it first (a slow start)
        self.prefill_gate: threading.Event | None = None  # generate waits for it while "reading the prompt"
        self.calls: list[tuple[list[list[int]], SamplingParams, SpecConfig]] = []
        self.cancelled = 0
        self.closed = False
        self._running: CancelToken | None = None

    # Engine interface -------------------------------------------------------
    def encode(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        return self.tokenizer.encode(prompt)

    def max_prompt_tokens(self, max_new_tokens: int, spec: SpecConfig | None = None) -> int:
        spec = spec or self.config.spec
        k = spec.k if spec.mode is not Mode.AR else 0
        return self.context - max_new_tokens - k - 2  # as Engine: SlotLayout.for_generation

    def cancel(self) -> None:
        """As Engine.cancel: reaches only a call already running."""
        self.cancelled += 1
        if self._running is not None:
            self._running.cancel()

    def close(self) -> None:
        self.closed = True

    def generate(
        self,
        prompts,
        params: SamplingParams,
        *,
        chat: bool = False,
        spec: SpecConfig | None = None,
        cancel: CancelToken | None = None,
        progress=None,
    ) -> Iterator[Event]:
        if self.gate is not None:
            self.gate.wait(10)
        token = self._running = cancel if cancel is not None else CancelToken()
        spec = spec or self.config.spec
        ids = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        if max(map(len, ids)) > self.max_prompt_tokens(params.max_new_tokens, spec):
            raise UsageError(
                "prompt + max-new-tokens exceeds the context (fake engine)",
                "shorten the prompt or lower --max-new-tokens",
            )
        self.calls.append((ids, params, spec))
        k = spec.k if spec.mode is not Mode.AR else 0
        if token.cancelled:  # as Engine: stopped before it began
            yield DoneEvent((Output("", (), FinishReason.CANCELLED),), RunStats(k=k).snapshot())
            return
        clock = self.clock
        stats = RunStats(k=k, mode=spec.mode.value, started=clock())
        budget = self.answer[: params.max_new_tokens]
        if progress is not None:  # as a long prompt's read is reported
            progress(PrefillProgress(len(ids[0]) // 2, len(ids[0])))
            if self.prefill_gate is not None:  # a test looks at the screen while the prompt is read
                self.prefill_gate.wait(10)
        clock.advance(PREFILL_S)
        first = TokensEvent(0, (budget[0],), self.tokenizer.decode(budget[:1]), (TokenOrigin.TARGET.value,), at=clock())
        stats.consume(PrefillEvent(PREFILL_S, 1, (len(ids[0]),), (0,)))
        stats.consume(first)
        yield first
        pos, rnd = 1, 0
        finish = FinishReason.LENGTH
        while pos < len(budget):
            if token.cancelled:
                finish = FinishReason.CANCELLED
                break
            if self.fail_after is not None and rnd >= self.fail_after:
                raise self.error
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.hold_after is not None and rnd == self.hold_after:
                deadline = time.monotonic() + 10
                while not token.cancelled and time.monotonic() < deadline:
                    time.sleep(0.01)
                continue
            clock.advance(ROUND_S[spec.mode])
            n_acc = min(ACCEPT_PATTERN[rnd % len(ACCEPT_PATTERN)], k)
            hit = HIT_PATTERN[rnd % len(HIT_PATTERN)] if spec.mode is Mode.SSD else None
            new = budget[pos : pos + n_acc + 1]
            draft_origin = TokenOrigin.DRAFT_HIT if hit else TokenOrigin.DRAFT
            origins = [draft_origin.value] * (len(new) - 1) + [TokenOrigin.TARGET.value]
            tokens = TokensEvent(0, tuple(new), self.tokenizer.decode(new), tuple(origins), at=clock())
            round_ = RoundEvent(
                rnd,
                (k,),
                (min(n_acc, len(new) - 1) if k else 0,),
                rows=(0,),
                n_emitted=(len(new),),
                draft_s=0.02 * bool(k) if not hit else 0.001,
                verify_s=0.04,
                ssd=SsdRound((hit,), "jit" if hit is False else None) if hit is not None else None,
            )
            stats.consume(tokens)
            stats.consume(round_)
            yield tokens
            now = stats.snapshot()  # as of this round, whenever it is read
            yield replace(round_, snapshot=LazySnapshot(lambda now=now: now))
            if self.mode_event_at == rnd:  # as Engine when its re-check switches mode
                yield ModeEvent(rnd, "ar", "switched from SD after 16 rounds: (fake)", "switched from SD (fake)")
            pos += len(new)
            rnd += 1
        generated = tuple(budget[:pos])
        yield DoneEvent((Output(self.tokenizer.decode(generated), generated, finish),), stats.snapshot())


class FakeMeter:
    """Scripted machine load (tui/load.Meter): each pair of samples (before and after a
    run or an answer) spans 5 virtual seconds in which other processes used the next of
    `others` cores (0 once they run out), on a machine of `cores` cores."""

    def __init__(self, others=(), cores: int = 2) -> None:
        self.others = list(others)
        self.cores = cores
        self.samples = 0
        self._wall = self._busy = self._ours = 0.0

    def __call__(self):
        from ssdlocal.tui.load import LoadSample

        self.samples += 1
        if self.samples % 2 == 0:  # after a run
            load = self.others.pop(0) if self.others else 0.0
            self._wall += 5.0
            self._ours += 5.0
            self._busy += 5.0 * (1.0 + load)
        return LoadSample(self._wall, self._busy, self._ours, self.cores)


def chat_settings(mode: Mode = Mode.SSD, draft: Any = "d", k: int = 4, fan_out=None, **sampling):
    """ChatSettings for tests: speculation fields by name, the rest to SamplingParams;
    `draft` as a user types it (None, "ngram", a path) or a Draft already made."""
    from ssdlocal.tui.core import ChatSettings

    made = draft if draft is not None and not isinstance(draft, str) else draft_of(draft)
    spec = SpecConfig(mode=mode, k=k, draft=made, fan_out=fan_out)
    return ChatSettings(spec, SamplingParams(**{"max_new_tokens": 256, **sampling}))
