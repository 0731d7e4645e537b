"""The draft side of an engine: the draft model in this process (SD), the SSD worker process
and its share of the CPU, the pair check, and when each is loaded.

`DraftSide` owns them for the engine's life and is what a seating asks for a drafter
(`make_drafter`). Policy, stated once: the pair's tokenizers are checked before the draft
model first loads; an SSD start spawns the worker before the target loads (they load
side by side); a draft that `auto` will not use waits unloaded until a call asks for it
(engine.auto.draft_waits / unloaded_draft), its context read from its file meanwhile; a
worker that failed is replaced when the next call needs it. Knows nothing about rounds.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from ssdlocal.backends import registry
from ssdlocal.backends.base import Runner
from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SamplingParams, SpecConfig
from ssdlocal.core.errors import UsageError
from ssdlocal.core.hostsync import Audit
from ssdlocal.draft.base import Drafter, DraftResources
from ssdlocal.draft.factory import make_drafter
from ssdlocal.engine.auto import ModeChoice, draft_waits, unloaded_draft
from ssdlocal.speculation.adaptive import CostModel

if TYPE_CHECKING:  # imported where used: the worker's client only when SSD runs
    from ssdlocal.draft.ssd.client import DraftWorkerClient
    from ssdlocal.placement.cpus import CpuPlan

log = logging.getLogger(__name__)
MAX_WORKER_FAILURES = 3  # SSD workers that may fail in an engine's life before SSD gives way to SD


class DraftSide:
    """The engine's draft model and SSD worker, loaded as the policy above says."""

    def __init__(self, config: EngineConfig, audit: Audit) -> None:
        self.config = config
        self.audit = audit
        self.spec: ModelSpec | None = config.draft_model  # None: the draft is no model
        self.runner: Runner | None = None  # the draft model here (SD), once loaded
        self.worker: DraftWorkerClient | None = None  # the SSD worker, once started
        self.cpu_plan: CpuPlan | None = None  # the cores' split while target and SSD draft share the CPU
        self.context: int | None = None  # the draft model's context: loaded, or as its file states
        self.worker_failures = 0  # SSD workers that failed (died, hung, broke the protocol)
        self._pair_checked = False

    # ------------------------------------------------------------------ at start
    def start(self, choice: ModeChoice | None) -> None:
        """Before the target loads: an SSD engine spawns its worker now (it loads the
        draft in its own process while the target loads here)."""
        if self.spec is not None and choice is not None and choice.mode is Mode.SSD:
            self._start_worker()

    def settle(self, choice: ModeChoice | None) -> None:
        """After the target loaded, before calibration: wait for the worker, or load the
        draft here unless it may wait (auto.draft_waits, with a context its file states)."""
        if self.worker is not None:
            self._wait_worker(self.worker)
        elif self.spec is not None and not self._may_wait(choice):
            self._load_here()

    def decide(self, choice: ModeChoice, costs: CostModel, k: int) -> ModeChoice:
        """After calibration: a draft that waited loads now if the measured costs say it
        could pay, else the choice says why it stays unloaded (auto.unloaded_draft)."""
        if self.spec is None or self.worker is not None or self.runner is not None:
            return choice
        waiting = unloaded_draft(choice, costs, k)  # None: it could pay
        if waiting is None:
            self._load_here()
        return waiting or choice

    def _may_wait(self, choice: ModeChoice | None) -> bool:
        """Whether the draft model may stay unloaded until a call asks for it and its file
        states its context, which bounds calls before it loads (engine.limits)."""
        assert self.spec is not None  # callers check
        if not draft_waits(self.config, choice):
            return False
        self.context = registry.context_length(self.spec.path, self.spec.backend)
        return self.context is not None

    def check_pair(self) -> None:
        """Target and draft tokenizers agree (weights/compat.check_pair; IncompatiblePairError
        with a hint), checked once, before the draft model first loads: at start for a mode
        that uses it, else when a call first asks for it (0.5-0.8 s saved at a start that
        never drafts)."""
        if self._pair_checked or self.spec is None:
            return
        from ssdlocal.weights.compat import check_pair, embedding_rows

        target, draft = self.config.target, self.spec
        check_pair(
            registry.load_tokenizer(target.path, target.backend),
            registry.load_tokenizer(draft.path, draft.backend),
            target_vocab=embedding_rows(target.path, target.backend),
            draft_vocab=embedding_rows(draft.path, draft.backend),
        )
        self._pair_checked = True

    # ------------------------------------------------------------------ the model here (SD)
    def _load_here(self) -> None:
        """Load the draft model in this process (synchronous SD)."""
        assert self.spec is not None  # callers check
        self.check_pair()
        loaded = registry.load(self.spec)
        self.context = loaded.args.max_position_embeddings
        runner = self.audit.watch(registry.make_runner(loaded, graphs=self.config.graphs), "draft")
        runner.setup_prefix(self.config.prefix_cache_tokens)
        self.runner = runner

    def runner_here(self) -> Runner:
        """The draft model in this process (SD), loaded on first use."""
        if self.runner is None:
            self._load_here()
        assert self.runner is not None
        return self.runner

    # ------------------------------------------------------------------ the SSD worker
    def _start_worker(self) -> DraftWorkerClient:
        """Spawn the SSD draft worker; on CPU-only placements split the cores."""
        from ssdlocal.draft.ssd.client import DraftWorkerClient
        from ssdlocal.placement.cpus import split_cpus

        assert self.spec is not None  # callers check
        self.check_pair()
        registry.preflight(self.spec.path, self.spec.backend)  # bad paths fail here, not in the worker
        both_cpu = self.config.target.device == "cpu" and self.spec.device == "cpu"
        # both on CPU: split the cores (thread counts always; affinity when pin_cpus),
        # otherwise two full thread pools oversubscribe the cores and both crawl
        plan = self.cpu_plan = split_cpus() if both_cpu else None
        self.worker = DraftWorkerClient(
            self.spec,
            threads=plan.draft_threads if plan else None,
            cpus=plan.draft_cpus if plan and self.config.pin_cpus else None,
            graphs=self.config.graphs,
            prefix_tokens=self.config.prefix_cache_tokens,
        )
        return self.worker

    def _wait_worker(self, worker: DraftWorkerClient) -> None:
        """Wait until `worker` has loaded the draft model."""
        worker.wait_loaded()
        self.context = worker.max_positions

    @property
    def ssd_given_up(self) -> bool:
        """Whether SSD workers failed MAX_WORKER_FAILURES times: SSD calls then run SD
        (engine.parts.Modes resolves them so and says why)."""
        return self._failures >= MAX_WORKER_FAILURES

    @property
    def _failures(self) -> int:
        return self.worker_failures + (self.worker is not None and self.worker.broken)

    @property
    def gave_up(self) -> str:
        """Why SSD calls run SD now (ssd_given_up), for people."""
        return (
            f"SSD's draft worker failed {self._failures} times: the draft model runs in this process (SD) "
            "from now on (the answers are the same; a new engine tries SSD again)"
        )

    def ready_worker(self) -> DraftWorkerClient:
        """The SSD draft worker, replaced when it failed on an earlier call."""
        if self.worker is not None and self.worker.broken:
            self.worker_failures += 1
            self._stop_worker()
        worker = self.worker
        if worker is None:
            worker = self._start_worker()
            self._wait_worker(worker)
        return worker

    def _stop_worker(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()

    @contextlib.contextmanager
    def pinned(self, spec: SpecConfig) -> Iterator[None]:
        """While an SSD call runs on a CPU-only placement, this process keeps to the
        target's cores (the worker has the others); the old affinity comes back after."""
        plan = self.cpu_plan if spec.mode is Mode.SSD else None
        pinned = plan.apply_to_this_process(pin_affinity=self.config.pin_cpus) if plan is not None else None
        try:
            yield
        finally:
            if pinned is not None:
                pinned.restore()

    # ------------------------------------------------------------------ per call
    def make_drafter(self, spec: SpecConfig, params: SamplingParams, offered: DraftResources) -> Drafter | None:
        """The drafter of one seating (None for AR), built by its draft type's row in
        draft.factory.BUILDERS from what the seating offers and this side's draft model,
        worker and audit."""
        configured = self.config.spec.draft.model
        if spec.draft.model is not None and spec.draft.model != configured:
            raise UsageError(
                f"this engine was loaded with draft {self.config.spec.draft.label!r}, not {spec.draft.label!r}",
                "create a new Engine to change the draft model",
            )
        resources = replace(
            offered,
            audit=self.audit,
            target_device_name=self.config.target.device,
            draft_runner=self.runner_here,
            worker=self.ready_worker,
        )
        return make_drafter(spec, params, resources)

    def prefix_report(self) -> dict | None:
        """The draft model's prefix cache: the one here, or the SSD worker's as of its
        latest batch start (None: neither keeps one)."""
        report = self.runner.prefix_report() if self.runner is not None else None
        if report is None and self.worker is not None:
            report = self.worker.prefix_report
        return report

    def forget_prefixes(self) -> None:
        """Empty the draft's prefix caches (the worker's empties when its process restarts)."""
        if self.runner is not None:
            self.runner.forget_prefixes()
        if self.worker is not None:
            self.worker.forget_prefixes()

    def interrupted(self) -> None:
        """Ctrl-C while a batch runs: the SSD worker is killed now, not waited for."""
        if self.worker is not None:
            self.worker.broken = True
            self._stop_worker()

    def close(self) -> None:
        """Stop the worker (if any). Idempotent; never hangs."""
        self._stop_worker()
