"""The Engine: loads the target (and draft), then per generate call a prefill and rounds.

The engine owns the target model and a drafter (none for AR, n-gram or a draft model
for SD, the async worker for SSD); each round is round.py's propose -> score -> verify
-> commit -> record. It never imports a UI library and yields events to its callers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ssdlocal.backends import registry
from ssdlocal.core.cancel import CancelToken
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.events import DoneEvent, Event, Output, PrefillProgress
from ssdlocal.core.hostsync import Audit
from ssdlocal.core.memory import keep_freed_memory, oom_error
from ssdlocal.core.sequence import Row
from ssdlocal.core.stats import RunStats
from ssdlocal.draft.base import DraftResources
from ssdlocal.draft.factory import make_drafter
from ssdlocal.draft.suffix import open_memory
from ssdlocal.engine.auto import ModeChoice, calibrated, draft_waits, placement_choice, unloaded_draft
from ssdlocal.engine.batch import Loop
from ssdlocal.engine.prompts import encode_prompt
from ssdlocal.engine.request import Inbox, Request
from ssdlocal.speculation.adaptive import CostModel

if TYPE_CHECKING:  # imported where used: the worker's client only when SSD runs
    from ssdlocal.draft.ssd.client import DraftWorkerClient
    from ssdlocal.placement.cpus import CpuPlan

log = logging.getLogger(__name__)


class Engine:
    """Loads the target (and draft) once; `generate` may be called many times. A draft
    model `auto` will not use (AR on llama.cpp's CPU kernels, or measured costs that say it
    cannot pay) is checked and loaded only when a call asks for it (_draft_may_wait).

    Use as a context manager so drafter processes are shut down deterministically.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        keep_freed_memory()  # forwards reuse their temporaries' memory (core.memory)
        spec = config.spec
        self._draft_runner = None
        self.audit = Audit()  # host waits per model, through core.hostsync
        self._worker: DraftWorkerClient | None = None  # the SSD draft worker, once started
        self._cpu_plan: CpuPlan | None = None  # the cores' split when target and SSD draft share the CPU
        self._tp_group = None  # ranks 1..N-1 of a tensor-parallel target
        self._row_cancels: set[int] = set()
        self._row_cancel_lock = threading.Lock()
        self.draft_context: int | None = None  # the draft model's context: loaded, or as its file states
        self._running: CancelToken | None = None  # the token of the latest generate call
        self._closed = False
        draft_model = spec.draft.model
        self.has_draft_model = draft_model is not None
        self._pair_checked = False  # _check_pair ran (before the draft model first loads)
        # `choice`: the mode this engine runs when asked for auto, and why (None: calibrated below)
        choice = placement_choice(config) if spec.mode is Mode.AUTO else ModeChoice(
            spec.mode, f"--mode {spec.mode.value} was asked for"
        )  # fmt: skip
        try:
            if draft_model is not None and choice is not None and choice.mode is Mode.SSD:
                self._start_worker()  # loads the draft in its own process while we load the target
            if len(config.target_devices) > 1:
                from ssdlocal.parallel.group import load_tensor_parallel

                self.target, self._tp_group = load_tensor_parallel(config.target, config.target_devices)
            else:
                self.target = registry.load(config.target)
            registry.claim_device(config.target.device)  # rank 0 of a TP target too
            self.tokenizer = self.target.tokenizer
            self.runner = self.audit.watch(registry.make_runner(self.target, graphs=config.graphs), "target")
            if self._worker is not None:
                self._wait_worker(self._worker)
            elif draft_model is not None and not self._draft_may_wait(choice):
                self._load_draft_here()
            # after the draft (when it loads now): the default size is a share of the memory left
            self.prefix_tokens = self.runner.setup_prefix(config.prefix_cache_tokens)
            self.costs = CostModel()  # the target's (and draft's) measured step costs, kept up to date
            self.acceptance_rates: dict[str, float] = {}  # by proposal source, learned across calls
            self.choice: ModeChoice = calibrated(
                choice, self.runner, self._draft_runner_here, spec, self.costs, config
            )  # (a CPU; timings kept per machine and models)
            if draft_model is not None and self._worker is None and self._draft_runner is None:
                waiting = unloaded_draft(self.choice, self.costs, spec.k)  # None: it could pay
                self.choice = waiting or self.choice
                if waiting is None:
                    self._load_draft_here()
            self.suffix_memory, self._memory_file = open_memory(
                spec.memory, config.target.path, self.target.args.vocab_size
            )  # fmt: skip
            log.info("mode %s: %s", self.choice.mode.value, self.choice.reason)
        except BaseException:
            self.close()
            raise

    def _draft_spec(self) -> ModelSpec:
        """The draft model's spec; only for an engine whose draft is a model (has_draft_model)."""
        draft_spec = self.config.draft_model
        assert draft_spec is not None, "no draft model is configured"
        return draft_spec

    def _draft_may_wait(self, choice: ModeChoice | None) -> bool:
        """Whether the draft model may stay unloaded until a call asks for it (auto.
        draft_waits) and its file states its context, which bounds calls before it loads
        (context_limit)."""
        draft = self._draft_spec()
        if not draft_waits(self.config, choice):
            return False
        self.draft_context = registry.context_length(draft.path, draft.backend)
        return self.draft_context is not None

    def _check_pair(self) -> None:
        """Target and draft tokenizers agree (weights/compat.check_pair; IncompatiblePairError
        with a hint), checked once, before the draft model first loads: at start for a mode
        that uses it, else when a call first asks for it (0.5-0.8 s saved at a start that
        never drafts)."""
        if self._pair_checked:
            return
        from ssdlocal.weights.compat import check_pair, embedding_rows

        target, draft = self.config.target, self._draft_spec()
        check_pair(
            registry.load_tokenizer(target.path, target.backend),
            registry.load_tokenizer(draft.path, draft.backend),
            target_vocab=embedding_rows(target.path, target.backend),
            draft_vocab=embedding_rows(draft.path, draft.backend),
        )
        self._pair_checked = True

    def _load_draft_here(self) -> None:
        """Load the draft model in this process (synchronous SD)."""
        self._check_pair()
        loaded = registry.load(self._draft_spec())
        self.draft_context = loaded.args.max_position_embeddings
        runner = self.audit.watch(registry.make_runner(loaded, graphs=self.config.graphs), "draft")
        runner.setup_prefix(self.config.prefix_cache_tokens)
        self._draft_runner = runner

    def _wait_worker(self, worker: DraftWorkerClient) -> None:
        """Wait until `worker` (the one _start_worker started) has loaded the draft model."""
        worker.wait_loaded()
        self.draft_context = worker.max_positions

    def _start_worker(self) -> DraftWorkerClient:
        """Spawn the SSD draft worker (kept in `_worker`, and returned); on CPU-only
        placements split the cores."""
        from ssdlocal.draft.ssd.client import DraftWorkerClient
        from ssdlocal.placement.cpus import split_cpus

        self._check_pair()
        draft_spec = self._draft_spec()
        registry.preflight(draft_spec.path, draft_spec.backend)  # bad paths fail here, not in the worker
        both_cpu = self.config.target.device == "cpu" and draft_spec.device == "cpu"
        # both on CPU: split the cores (thread counts always; affinity when pin_cpus),
        # otherwise two full thread pools oversubscribe the cores and both crawl
        plan = self._cpu_plan = split_cpus() if both_cpu else None
        worker = self._worker = DraftWorkerClient(
            draft_spec,
            threads=plan.draft_threads if plan else None,
            cpus=plan.draft_cpus if plan and self.config.pin_cpus else None,
            graphs=self.config.graphs,
            prefix_tokens=self.config.prefix_cache_tokens,
        )
        return worker

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the draft worker (if any). Idempotent; never hangs."""
        self._closed = True
        try:
            self._stop_worker()
        finally:
            group, self._tp_group = self._tp_group, None
            if group is not None:
                group.close()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

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
        with self._row_cancel_lock:
            self._row_cancels.update(rows)

    def _take_row_cancels(self) -> set[int]:
        with self._row_cancel_lock:
            taken, self._row_cancels = self._row_cancels, set()
        return taken

    def _apply_row_cancels(self, rows: list[Row]) -> None:
        for b in self._take_row_cancels():
            if 0 <= b < len(rows) and rows[b].active:
                rows[b].finish_reason = "cancelled"

    # ----------------------------------------------------------------- helpers
    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.target.eos_token_ids)

    def context_limit(self, spec: SpecConfig | None = None) -> tuple[int, str]:
        """(positions one generate call may fill, the model that sets the limit).

        The target's context, and the draft model's when `spec` runs it: SSD's draft
        also holds the unverified proposal (K + 2 more positions)."""
        spec = self._resolved(spec or self.config.spec)
        limit, which = self.target.args.max_position_embeddings, "the target model"
        if spec.mode is not Mode.AR and spec.draft.model is not None and self.draft_context is not None:
            extra = spec.k + 2 if spec.mode is Mode.SSD else 0
            if self.draft_context - extra < limit:
                limit, which = self.draft_context - extra, "the draft model"
        return limit, which

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
        limit, which = self.context_limit(spec)
        for n in prompt_lengths:
            if max_new_tokens is None and n >= limit:
                raise UsageError(
                    f"the prompt has {n} tokens, {which}'s context is {limit}",
                    "shorten the prompt",
                )
            if max_new_tokens is not None and n + max_new_tokens > limit:
                raise UsageError(
                    f"prompt ({n} tokens) + max-new-tokens ({max_new_tokens}) needs "
                    f"{n + max_new_tokens} positions, {which}'s context is {limit}",
                    "shorten the prompt or lower --max-new-tokens",
                )
        return [limit - n if max_new_tokens is None else max_new_tokens for n in prompt_lengths]

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of one prompt, through the chat template when `chat`."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def _make_drafter(self, spec: SpecConfig, params: SamplingParams, batch: int, num_slots: int, guides=None,
                      row_params: tuple[SamplingParams, ...] = ()):  # fmt: skip
        if spec.draft.model is not None and spec.draft.model != self.config.spec.draft.model:
            raise UsageError(
                f"this engine was loaded with draft {self.config.spec.draft.label!r}, not {spec.draft.label!r}",
                "create a new Engine to change the draft model",
            )
        resources = DraftResources(
            self.target.args.vocab_size, self.runner.device, self.config.target.device, batch, num_slots,
            draft_runner=self._draft_runner_here, worker=self._ready_worker, memory=self.suffix_memory,
            costs=self.costs, rates=self.acceptance_rates, guides=guides, audit=self.audit, row_params=row_params,
        )  # fmt: skip
        return make_drafter(spec, params, resources)

    def _draft_runner_here(self):
        """The draft model in this process (SD), loaded on first use."""
        if self._draft_runner is None:
            self._load_draft_here()
        return self._draft_runner

    def _ready_worker(self):
        """The SSD draft worker, replaced when it failed on an earlier call."""
        if self._worker is not None and self._worker.broken:
            self._stop_worker()
        worker = self._worker
        if worker is None:
            worker = self._start_worker()
            self._wait_worker(worker)
        return worker

    def _guard(self, fn, *args):
        """fn(*args) on the target, with running out of memory turned into a clear error."""
        try:
            return fn(*args)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # noqa: PERF203
            mapped = oom_error(exc, f"running the target on {self.target.device}")
            if mapped is None:
                raise
            raise mapped from exc

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
        spec = spec or self.config.spec
        reason = self._reason(spec)
        resolved = self._resolved(spec)
        ids = self._prompt_ids(prompts, chat)
        self.token_budgets([len(x) for x in ids], params.max_new_tokens, resolved)  # too long: refused here
        grammars = list(grammars) if grammars is not None else [None] * len(ids)
        if len(grammars) != len(ids):
            raise ValueError(f"{len(grammars)} grammars for {len(ids)} prompts")
        requests = [Request(tuple(x), params, g) for x, g in zip(ids, grammars)]
        self._take_row_cancels()  # cancels meant for an earlier call
        token = self._running = cancel if cancel is not None else CancelToken()
        stats = RunStats(k=resolved.k if resolved.mode is not Mode.AR else 0, mode=resolved.mode.value,
                         mode_reason=reason)  # fmt: skip
        if token.cancelled:  # stopped before it began
            yield DoneEvent(tuple(Output("", (), "cancelled") for _ in ids), stats.snapshot())
            return
        loop = Loop(self, spec, reason, token, progress=progress)
        yield from loop.run(requests, stats)
        rows = [seat.row for seat in loop.seats]
        outputs = tuple(Output(r.text(), tuple(r.generated), r.finish_reason or "length") for r in rows)
        yield DoneEvent(outputs, stats.snapshot())

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
        loop = Loop(self, spec, self._reason(spec), token, inbox=inbox, max_batch=max_batch)
        yield from loop.run([])

    def interrupted(self) -> None:
        """Ctrl-C while a batch runs (engine/batch.py calls it before cleaning up): the SSD
        worker is killed now, not waited for."""
        if self._worker is not None:
            self._worker.broken = True
            self._stop_worker()

    def _graph_reports(self, drafter, since: dict | None = None) -> dict[str, dict]:
        """Captured-step counts per model, minus `since` (the reports at the call's start)."""
        since = since or {}
        reports = {"target": self.runner.graph_report(since.get("target"))}
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None:  # SD: the draft model runs here
            reports["draft"] = draft_runner.graph_report(since.get("draft"))
        elif hasattr(drafter, "graph_report") and drafter.graph_report() is not None:
            reports["draft"] = drafter.graph_report()  # SSD: counted in the worker
        return reports

    def _resolved(self, spec: SpecConfig) -> SpecConfig:
        """`spec` as a call runs it: auto resolved to the engine's mode; SSD's K, which its
        trees are built for, at most SpecConfig's default when K was left to the engine."""
        if spec.mode is Mode.AUTO:
            spec = replace(spec, mode=self.choice.mode)
        if spec.mode is Mode.SSD and spec.adaptive_k and spec.k > SpecConfig.k:
            spec = replace(spec, k=SpecConfig.k, fan_out=None, fan_out_miss=None)
        return spec

    def _reason(self, spec: SpecConfig) -> str:
        """Why a call with `spec` runs the mode it runs: the engine's choice (auto, or its
        configured mode), or the mode this call asked for."""
        if spec.mode is Mode.AUTO or spec is self.config.spec:
            return self.choice.reason
        return f"--mode {spec.mode.value} was asked for"

    def _prompt_ids(self, prompts, chat: bool) -> list[list[int]]:
        if not prompts:
            raise UsageError("no prompt given", "pass at least one prompt")
        ids = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        if any(len(x) == 0 for x in ids):
            raise UsageError("empty prompt", "pass some text to generate from")
        return ids

    def prefix_reports(self) -> dict[str, dict]:
        """The prefix caches' sizes and counts per model ("target"; "draft": the draft model
        here, or the SSD worker's as of its latest batch start)."""
        out = {}
        for name, runner in (("target", self.runner), ("draft", self._draft_runner)):
            report = runner.prefix_report() if runner is not None else None
            if report is not None:
                out[name] = report
        worker = self._worker.prefix_report if self._worker is not None else None
        if worker is not None and "draft" not in out:
            out["draft"] = worker  # the SSD worker's, as it reported when the batch started
        return out

    def forget_prefixes(self) -> None:
        """Empty the prefix caches (the next call reads its prompts in full), e.g. to time a
        cold prompt. The SSD worker's cache empties when its process restarts."""
        for runner in (self.runner, self._draft_runner):
            if runner is not None:
                runner.forget_prefixes()
        if self._worker is not None:
            self._worker.forget_prefixes()
