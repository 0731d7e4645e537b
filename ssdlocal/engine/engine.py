"""The Engine: loads the target (and draft), then per generate call a prefill and rounds.

The engine owns the target model (one device, or a tensor-parallel group) and its lifecycle;
the draft side (engine/drafts.py) owns the draft model, the SSD worker and when they load;
the loop (engine/batch.py) runs calls through the parts the engine hands it
(engine/parts.py). Each round is round.py's propose -> score -> verify -> commit -> record.
It never imports a UI library and yields events to its callers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from ssdlocal.backends import registry
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import EngineConfig, Mode, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent, Event, Output, PrefillProgress
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.memory import keep_freed_memory
from ssdlocal.core.sequence import FinishReason, Request
from ssdlocal.core.stats import RunStats
from ssdlocal.draft.suffix import open_memory
from ssdlocal.engine.auto import ModeChoice, calibrated, placement_choice
from ssdlocal.engine.batch import Loop
from ssdlocal.engine.drafts import DraftSide
from ssdlocal.engine.limits import ContextLimits
from ssdlocal.engine.parts import EngineParts, Guard, Modes, RowCancels, SuffixStore
from ssdlocal.engine.prompts import encode_prompt
from ssdlocal.engine.reports import prefix_reports
from ssdlocal.engine.request import Inbox
from ssdlocal.speculation.adaptive import CostModel
from ssdlocal.speculation.suffix import SuffixMemory

log = logging.getLogger(__name__)


class Engine:
    """Loads the target (and draft) once; `generate` may be called many times. A draft
    model `auto` will not use (AR on llama.cpp's CPU kernels, or measured costs that say it
    cannot pay) is checked and loaded only when a call asks for it (engine/drafts.py).

    Use as a context manager so drafter processes are shut down deterministically.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        keep_freed_memory()  # forwards reuse their temporaries' memory (core.memory)
        spec = config.spec
        self.audit = Audit()  # host waits per model, through core.hostsync
        self.drafts = DraftSide(config, self.audit)
        self.tp_group = None  # ranks 1..N-1 of a tensor-parallel target
        self.cancels = RowCancels()
        self._running: CancelToken | None = None  # the token of the latest generate call
        self._closed = False
        self.has_draft_model = spec.draft.model is not None
        # the mode this engine runs when asked for auto, and why (None: calibrated below)
        choice: ModeChoice | None = (
            placement_choice(config)
            if spec.mode is Mode.AUTO
            else ModeChoice(spec.mode, f"--mode {spec.mode.value} was asked for")
        )
        try:
            self.drafts.start(choice)  # SSD: the worker loads the draft while we load the target
            self._load_target()
            self.drafts.settle(choice)
            # after the draft (when it loads now): the default size is a share of the memory left
            self.prefix_tokens = self.runner.setup_prefix(config.prefix_cache_tokens)
            self.costs = CostModel()  # the target's (and draft's) measured step costs, kept up to date
            self.acceptance_rates: dict[str, float] = {}  # by proposal source, learned across calls
            # (a CPU: timings kept per machine and models)
            choice = calibrated(choice, self.runner, self.drafts.runner_here, spec, self.costs, config)
            self.modes = Modes(spec, self.drafts.decide(choice, self.costs, spec.k), self.drafts)
            memory, memory_file = open_memory(spec.memory, config.target.path, self.target.args.vocab_size)
            self.suffix = SuffixStore(memory, memory_file)
            self.limits = ContextLimits(
                self.target.args.max_position_embeddings, lambda: self.drafts.context, self.modes.resolved
            )
            self.parts = self._parts()
            log.info("mode %s: %s", self.choice.mode.value, self.choice.reason)
        except BaseException:
            self.close()
            raise

    def _load_target(self) -> None:
        """The target (a tensor-parallel group over several devices), its tokenizer and runner."""
        config = self.config
        if len(config.target_devices) > 1:
            from ssdlocal.parallel.group import load_tensor_parallel

            self.target, self.tp_group = load_tensor_parallel(config.target, config.target_devices)
        else:
            self.target = registry.load(config.target)
        registry.claim_device(config.target.device)  # rank 0 of a TP target too
        self.tokenizer = self.target.tokenizer
        self.runner = self.audit.watch(registry.make_runner(self.target, graphs=config.graphs), "target")

    def _parts(self) -> EngineParts:
        args = self.target.args
        return EngineParts(
            target=self.runner,
            guard=Guard(self.target.device),
            drafts=self.drafts,
            modes=self.modes,
            limits=self.limits,
            suffix=self.suffix,
            cancels=self.cancels,
            audit=self.audit,
            costs=self.costs,
            rates=self.acceptance_rates,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            eos_ids=self.eos_ids,
            tokenizer=self.tokenizer,
        )

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the draft worker and the tensor-parallel ranks (if any). Idempotent; never hangs."""
        self._closed = True
        try:
            self.drafts.close()
        finally:
            group, self.tp_group = self.tp_group, None
            if group is not None:
                group.close()

    def cancel(self) -> None:
        """Ask the running `generate` to stop after the current round (thread-safe).

        Only a call already running is reached; to stop a call that may not have started
        yet, pass it a CancelToken (`generate(..., cancel=token)`) and cancel that."""
        token = self._running
        if token is not None:
            token.cancel()

    def cancel_rows(self, rows: Iterable[int]) -> None:
        """Stop some rows of the running `generate` (thread-safe): they finish with
        "cancelled" at the next round boundary, the other rows go on unchanged."""
        self.cancels.add(rows)

    def interrupted(self) -> None:
        """Ctrl-C while a batch runs: the SSD worker is killed now, not waited for."""
        self.drafts.interrupted()

    # ----------------------------------------------------------------- facts
    @property
    def choice(self) -> ModeChoice:
        """The mode this engine runs when asked for auto, and why (set another to change
        what later calls run)."""
        return self.modes.choice

    @choice.setter
    def choice(self, choice: ModeChoice) -> None:
        self.modes.choice = choice

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.target.eos_token_ids)

    @property
    def draft_context(self) -> int | None:
        """The draft model's context: loaded, or as its file states (None: unknown)."""
        return self.drafts.context

    @property
    def suffix_memory(self) -> SuffixMemory:
        """The engine's memory of earlier prompts and answers, which later calls' suffix
        proposals read; set another to keep separate memories (bench's sessions do)."""
        return self.suffix.memory

    @suffix_memory.setter
    def suffix_memory(self, memory: SuffixMemory) -> None:
        self.suffix.memory = memory

    def context_limit(self, spec: SpecConfig | None = None) -> tuple[int, str]:
        """(positions one generate call may fill, the model that sets the limit): the
        target's context, and the draft model's when `spec` runs it (engine/limits.py)."""
        return self.limits.limit(spec or self.config.spec)

    @property
    def context(self) -> int:
        """Positions a prompt and its new tokens may fill (both models' contexts)."""
        return self.context_limit()[0]

    def max_prompt_tokens(self, max_new_tokens: int | None, spec: SpecConfig | None = None) -> int:
        """The longest prompt that leaves room for `max_new_tokens` (None: at least one)."""
        return self.context_limit(spec)[0] - (max_new_tokens or 1)

    def token_budgets(
        self, prompt_lengths: Sequence[int], max_new_tokens: int | None, spec: SpecConfig | None = None
    ) -> list[int]:
        """New tokens each prompt may get: `max_new_tokens`, or (None) the rest of the
        context. UsageError when a prompt leaves no room for them."""
        return self.limits.budgets(prompt_lengths, max_new_tokens, spec or self.config.spec)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of one prompt, through the chat template when `chat`."""
        return encode_prompt(self.tokenizer, prompt, chat)

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        chat: bool = False,
        spec: SpecConfig | None = None,
        cancel: CancelToken | None = None,
        grammars: Sequence | None = None,
        progress: Callable[[PrefillProgress], None] | None = None,
    ) -> Iterator[Event]:
        """Generate for every prompt (strings, or token-id lists) and yield events.

        `grammars` (a grammar.compiler.Grammar or None per prompt) holds rows to a grammar
        in every mode (engine/shape.py); `params.logprobs` adds TokensEvent.logprobs.

        `spec` overrides the engine's speculation settings for this call (mode, K,
        fan-out, backup, C); the draft model itself cannot change. `cancel` stops the
        call after its current round, or within one chunk while a long prompt is read;
        cancelled before the call starts, it returns at once (every row "cancelled", no
        tokens). `progress` is called (on the engine's thread) as a long prompt is read.
        Each row starts from the longest prefix of its prompt that the prefix cache holds
        (earlier calls' prompts and answers) and reads only the rest.
        Yields TokensEvent as tokens are committed, a RoundEvent per verification,
        and finally one DoneEvent with per-row outputs and the stats snapshot.
        While an SSD call runs on a CPU-only placement, this process is pinned to the
        target's cores (the worker has the others); the old affinity is restored after.
        """
        started = time.perf_counter()
        spec = spec or self.config.spec
        resolved = self.modes.resolved(spec)
        ids = self._prompt_ids(prompts, chat)
        self.limits.budgets([len(x) for x in ids], params.max_new_tokens, resolved)  # too long: refused here
        grammars = list(grammars) if grammars is not None else [None] * len(ids)
        if len(grammars) != len(ids):
            raise ValueError(f"{len(grammars)} grammars for {len(ids)} prompts")
        requests = [Request(tuple(x), params, g) for x, g in zip(ids, grammars)]
        self.cancels.take()  # cancels meant for an earlier call
        token = self._running = cancel if cancel is not None else CancelToken()
        if token.cancelled:  # stopped before it began
            k = resolved.k if resolved.mode is not Mode.AR else 0
            stats = RunStats(k=k, mode=resolved.mode.value, mode_reason=self.modes.reason(spec), started=started)
            yield DoneEvent(tuple(Output("", (), FinishReason.CANCELLED) for _ in ids), stats.snapshot())
            return
        loop = Loop(self.parts, spec, token, progress=progress, started=started)
        yield from loop.run(requests)
        outputs = tuple(Output(r.text(), tuple(r.generated), r.finish_reason or FinishReason.LENGTH) for r in loop.rows)
        assert loop.stats is not None  # a call with prompts always seats them
        yield DoneEvent(outputs, loop.stats.snapshot())

    def serve(
        self, inbox: Inbox, *, max_batch: int, spec: SpecConfig | None = None, cancel: CancelToken | None = None
    ) -> Iterator[Event]:
        """Continuous batching: run the requests `inbox` brings (engine.request.Inbox, fed
        from any thread) until it is closed and every row is done, or `cancel` (or
        `Engine.cancel`) stops it (rows then finish "cancelled").

        Requests join the running batch at a round boundary, at most `max_batch` rows, and
        leave when done (engine/batch.py: re-seating). Each seating starts with a
        SeatedEvent (row index -> request id, for every later event until the next one)
        and ends with a SeatingDoneEvent (its stats). A seated request cancelled through the
        inbox finishes "cancelled" at the next boundary; a row's tokens end with the
        TokensEvent whose finish_reason is set. At T = 0 every request gets the tokens it
        gets alone."""
        spec = spec or self.config.spec
        token = self._running = cancel if cancel is not None else CancelToken()
        loop = Loop(self.parts, spec, token, inbox=inbox, max_batch=max_batch)
        yield from loop.run([])

    def _prompt_ids(self, prompts, chat: bool) -> list[list[int]]:
        if not prompts:
            raise UsageError("no prompt given", "pass at least one prompt")
        ids = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        if any(len(x) == 0 for x in ids):
            raise UsageError("empty prompt", "pass some text to generate from")
        return ids

    # ----------------------------------------------------------------- caches
    def prefix_reports(self) -> dict[str, dict]:
        """The prefix caches' sizes and counts per model ("target"; "draft": the draft model
        here, or the SSD worker's as of its latest batch start)."""
        return prefix_reports(self.runner, self.drafts)

    def forget_prefixes(self) -> None:
        """Empty the prefix caches (the next call reads its prompts in full), e.g. to time a
        cold prompt. The SSD worker's cache empties when its process restarts."""
        self.runner.forget_prefixes()
        self.drafts.forget_prefixes()
