"""`--mode auto`: which exact mode runs fastest on this placement, why, and whether the
rounds themselves still agree.

The placement decides most cases before anything loads (placement/mode.py, the same
words `devices` prints). Target and draft both on the CPU share one memory system: with K
chosen per round the mode is SD, which measures every round; with K pinned a short
calibration times the loaded models (target forward at 1 and K+1 tokens, draft forward at
1 token) and predicts whether SD beats AR. Either way the calibration may have run on a
busy machine, so `ModeCheck` compares the SD rounds' measured speed with what plain steps
would give at the same load, and switches to AR (saying why) when its own rounds say SD
is slower. Progress of the calibration goes to core.progress.

The calibration's timings are kept (core/measured.py) by machine, model files, backend,
dtype/quantization and threads: a later start with the same models on the same machine
reads them and starts in the time it takes to load the weights; the re-check above still
watches every SD call, so a machine busier than at calibration is still caught.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from ssdlocal.backends import registry
from ssdlocal.backends.base import Logits
from ssdlocal.core.config import EngineConfig, Mode, normalize_device
from ssdlocal.core.events import ModeEvent, RoundEvent
from ssdlocal.core.measured import MeasuredStore, file_stamps, positive_seconds
from ssdlocal.core.progress import reporter
from ssdlocal.speculation.adaptive import CostModel, model_cannot_pay
from ssdlocal.placement.mode import ModeChoice, batch_exact, cpu_shared, placement_mode

__all__ = [
    "ModeChoice",
    "Calibration",
    "ModeCheck",
    "calibrate",
    "calibrated",
    "calibrated_choice",
    "draft_waits",
    "placement_choice",
    "rechecked",
    "step_costs",
    "unloaded_draft",
]

log = logging.getLogger(__name__)

PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before anything was generated
CALIBRATION_PROMPT = 16  # tokens of context the timed forwards attend to
REPEATS = 5
CHECK_ROUNDS = 32  # SD rounds a re-check looks at (probes and catch-ups included)
# plain steps must be predicted this much faster before SD gives way. Small: SD that does
# not pay is at best as fast as plain steps (its plain rounds carry the drafter's upkeep),
# so giving way early costs little where SD and AR tie, and a wider margin let SD run 6-10%
# below AR on chat on the llama.cpp backend. Its rounds are timed whole (see _Rechecked).
CHECK_MARGIN = 1.05


@dataclass(frozen=True)
class Calibration:
    """Median seconds of one forward: target at 1 and at K+1 tokens, draft at 1 token."""

    k: int
    target_1: float
    target_k1: float
    draft_1: float
    when: str = "at load"  # or at an earlier start, read from the cache (core/measured.py)

    def predicted(self, acceptance: float = PRIOR_ACCEPTANCE) -> tuple[float, float]:
        """(AR, SD) tokens per second: AR makes one token per target forward; an SD round
        costs K draft forwards and one K+1-token verify and yields E tokens on average."""
        a, k = acceptance, self.k
        tokens_per_round = (1 - a ** (k + 1)) / (1 - a)  # E[accepted] + 1 for capped geometric
        return 1.0 / self.target_1, tokens_per_round / (k * self.draft_1 + self.target_k1)

    def describe(self) -> str:
        return (
            f"measured {self.when}: target {self.target_1 * 1e3:.0f} ms/token and "
            f"{self.target_k1 * 1e3:.0f} ms per {self.k + 1}-token verify, draft "
            f"{self.draft_1 * 1e3:.0f} ms/token"
        )


def placement_choice(config: EngineConfig) -> ModeChoice | None:
    """The mode the placement alone decides, or None when only a calibration can (target
    and draft model on the CPU: always calibrated, for the costs K per round starts from).
    A llama.cpp target on the CPU without batch-invariant steps: AR (placement/mode.py)."""
    spec = config.spec
    draft = spec.draft
    kind = "none" if draft.kind == "none" else "model" if draft.model is not None else draft.kind
    targets = tuple(map(normalize_device, config.target_devices or (config.target.device,)))
    draft_device = normalize_device(draft.model.device) if draft.model is not None else None
    exact = batch_exact(config.target.backend, targets, config.target.batch_invariant)
    choice = placement_mode(targets, draft_device, kind, draft.label, spec.adaptive_k, batch_exact=exact)
    if choice is not None and choice.mode is Mode.SD and kind == "model" and draft_device == "cpu":
        return None  # SD on a shared CPU: calibrated_choice says it, with what was measured
    return choice


def draft_waits(config: EngineConfig, choice: ModeChoice | None) -> bool:
    """Whether the draft model (SD in this process) may stay unloaded until a call asks for
    it: `auto` chose AR by the placement (`choice`; a llama.cpp target on the CPU), or K is
    chosen per round on a CPU that shares target and draft (`choice` None), where a draft
    that cannot pay at any acceptance is never asked for (unloaded_draft)."""
    spec = config.spec
    chose_ar = spec.mode is Mode.AUTO and choice is not None and choice.mode is Mode.AR
    return chose_ar or (choice is None and spec.adaptive_k and config.target.device == "cpu")


def unloaded_draft(choice: ModeChoice, costs: CostModel, k: int) -> ModeChoice | None:
    """After calibration, for a draft that waited (draft_waits): the engine's choice saying
    why the draft model stays unloaded (the mode is AR, or on the measured costs it cannot
    pay at any acceptance: speculation.adaptive.model_cannot_pay), so that a call that asks
    for SD loads it; None when it could pay (load it now)."""
    if choice.mode is not Mode.AR and not model_cannot_pay(costs, k, [True]):
        return None
    why = "the mode is AR" if choice.mode is Mode.AR else "on the measured costs it cannot pay at any acceptance"
    log.info("draft model not loaded: %s", why)
    return replace(
        choice, reason=f"{choice.reason}; the draft model is not loaded ({why}): a call that asks for SD loads it"
    )


def calibrate(target, draft, k: int) -> Calibration:
    """Time the loaded runners (their caches are reset: call between generations)."""
    progress = _Steps("calibrating target and draft", 3 * (REPEATS + 1))
    return Calibration(
        k,
        _time_steps(target, 1, REPEATS, progress),
        _time_steps(target, k + 1, REPEATS, progress),
        _time_steps(draft, 1, REPEATS, progress),
    )


WIDTHS = (1, 2, 3, 4, 5, 8, 9, 12, 13)  # CPU kernels take rows in blocks (of 4): costs step


def step_costs(runner, widths=WIDTHS, repeats: int = 2) -> dict[int, float]:
    """Seconds of one target step at each width (the adaptive K's cost model starts from
    these on a CPU, where a step's cost rises in blocks of rows rather than smoothly)."""
    progress = _Steps("calibrating step widths", len(widths) * (repeats + 1))
    return {w: _time_steps(runner, w, repeats, progress) for w in widths}


class _Steps:
    """Counts timed forwards for the progress display (if one is installed)."""

    def __init__(self, stage: str, total: int) -> None:
        self.stage, self.total, self.done = stage, total, 0
        self.progress = reporter()
        self.tick(0)

    def tick(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.stage, min(self.done, self.total), self.total)


def _time_steps(runner, width: int, repeats: int = REPEATS, progress: _Steps | None = None) -> float:
    runner.reset(1, CALIBRATION_PROMPT + width + 2)
    runner.feed([list(range(1, CALIBRATION_PROMPT + 1))], Logits.NONE)
    runner.begin_steps()
    ids = torch.ones(1, width, dtype=torch.long, device=runner.device)
    runner.step(ids)  # warm-up (first-call allocations)
    times = []
    for _ in range(repeats):
        if progress is not None:
            progress.tick()
        t0 = time.perf_counter()
        runner.step(ids).sum().item()  # .item(): wait for the device
        times.append(time.perf_counter() - t0)
    if progress is not None:
        progress.tick()
    return min(times)  # the least disturbed run: the cost without other load


def calibrated_choice(cal: Calibration, adaptive_k: bool = False) -> ModeChoice:
    """AR or SD for a target and draft sharing the CPU, from measured forward costs; with
    adaptive K, SD, which keeps choosing per round (a plain step when drafting does not pay)."""
    shared = cpu_shared(adaptive_k)
    if shared is not None:
        return shared.measured(cal.describe())
    ar, sd = cal.predicted()
    mode = Mode.SD if sd > ar else Mode.AR
    predicted = f"predicted AR {ar:.1f} vs SD {sd:.1f} tok/s at {PRIOR_ACCEPTANCE:.0%} acceptance"
    return ModeChoice(
        mode,
        f"target and draft share the CPU (SSD would split its cores); {cal.describe()}: {predicted}",
        f"target and draft share the CPU; {predicted}",
    )


@dataclass
class ModeCheck:
    """Whether SD's own rounds still beat plain steps at the load they ran under.

    Seeded with the calibration's step costs (seconds by scored width). Each SD round
    tells it the tokens it emitted, its seconds, and its verify seconds at its width: the
    ratio of that verify time to the calibration's cost at that width is the load the
    round ran under, so in the round's time plain steps would have made
    `rows * seconds / (t1 * load)` tokens. Over the last CHECK_ROUNDS rounds, when the
    rounds' tokens fall short of that by CHECK_MARGIN, `observe` returns the AR choice that
    says so (once). A round stalled by another process inflates its seconds and its load
    alike, so it counts as much as any other; a costly round (a probe that catches the
    draft up) counts at its cost. The call's first model-drafting round, where the draft
    reads the prompt once, is left out: a cost already paid says nothing about the rest.
    """

    widths: dict[int, float]  # calibrated seconds of one target step by scored tokens
    rounds: int = CHECK_ROUNDS
    margin: float = CHECK_MARGIN
    window: list[tuple[float, float, float]] = field(default_factory=list)  # (tokens, s, plain tokens)
    done: bool = False
    _drafted: bool = False  # the first model-drafting round was seen (and skipped)

    def observe(
        self,
        rows: int,
        emitted: float,
        draft_s: float,
        verify_s: float,
        scored: int,
        model_drafted: bool = False,
        wall_s: float | None = None,
    ) -> ModeChoice | None:
        """One SD round; `wall_s`: the whole round's seconds (drafting and verifying, and
        what lies between and after them: choosing K, the draft's upkeep, committing),
        else draft_s + verify_s. Returns the AR choice once the window says SD is slower."""
        seconds = max(wall_s or 0.0, draft_s + verify_s)
        if self.done or 1 not in self.widths or seconds <= 0 or verify_s <= 0 or rows <= 0:
            return None
        if model_drafted and not self._drafted:
            self._drafted = True
            return None
        base = self._cost(scored)
        load = verify_s / base if base > 0 else 1.0
        plain = rows * seconds / (self.widths[1] * load)  # tokens plain steps make in that time
        self.window.append((emitted, seconds, plain))
        self.window = self.window[-self.rounds :]
        if len(self.window) < self.rounds:
            return None
        tokens, total_s, plain_tokens = (sum(x) for x in zip(*self.window))
        if tokens * self.margin >= plain_tokens:
            return None
        self.done = True
        sd_rate, ar_rate = tokens / total_s, plain_tokens / total_s
        return ModeChoice(
            Mode.AR,
            f"switched from SD after {len(self.window)} rounds: they made {sd_rate:.1f} tok/s, "
            f"and plain steps at the load they ran under would make {ar_rate:.1f} ({load:.1f}x "
            "the calibration's step costs in the last round)",
            f"switched from SD: its rounds made {sd_rate:.1f} tok/s, plain steps would make {ar_rate:.1f}",
        )

    def round(self, event, wall_s: float | None = None) -> ModeChoice | None:
        """observe() for one RoundEvent (its rows, tokens taken, seconds, widest proposal)
        and, when known, the round's whole wall time."""
        scored = 1 + max(event.n_drafted, default=0)
        sources = event.sources
        drafted = ("model" in sources) if sources is not None else max(event.n_drafted, default=0) > 0
        return self.observe(
            len(event.rows),
            sum(event.n_emitted),
            event.draft_s,
            event.verify_s,
            scored,
            model_drafted=drafted,
            wall_s=wall_s,
        )

    def _cost(self, scored: int) -> float:
        if scored in self.widths:
            return self.widths[scored]
        known = sorted(self.widths)
        above = [w for w in known if w >= scored]
        return self.widths[above[0] if above else known[-1]]


def model_key(model) -> list:
    """What a model's timings depend on (a core.models.ModelSpec): its files (path, sizes,
    mtimes), backend and the build of its library (registry.Backend.build: llama.cpp's
    version and native files), device, dtype, quantization, and batch-invariant steps
    when asked."""
    alike = ["batch-invariant"] if model.batch_invariant else []
    build = registry.backend_for(model.backend).build()
    library = [build] if build is not None else []
    return [*file_stamps(model.path), model.backend, *library, model.device, model.dtype, model.quantization, *alike]


def calibrated(choice: ModeChoice | None, target, draft, spec, costs, config: EngineConfig | None = None) -> ModeChoice:
    """The engine's choice once its target is loaded: `choice` itself when the placement
    decided it; for target and draft sharing the CPU (None) a calibration's, seeding the
    K-per-round cost model (`costs`) and carrying the step costs its re-check reads
    (ModeChoice.widths). An SD on the CPU with K per round also times each step width.
    `draft()` gives the draft runner (loading it); it is called only when the pair must be
    timed. With `config` (the engine's), timings are read from and kept in the cache's
    measurements (core/measured.py) instead of timed at every start."""
    store = MeasuredStore() if config is not None else None
    models = [model_key(config.target)] if config is not None else []
    if choice is None:  # target and draft share the CPU: measure them
        drafts = [model_key(config.draft_model)] if config is not None else []
        cal = _pair_calibration(target, draft, spec.k, store, {"models": models + drafts, "k": spec.k})
        costs.seed(cal.target_1, cal.target_k1, spec.k + 1, cal.draft_1)
        choice = replace(calibrated_choice(cal, spec.adaptive_k), widths={1: cal.target_1, spec.k + 1: cal.target_k1})
    if spec.adaptive_k and target.device.type == "cpu" and choice.mode is not Mode.AR:
        widths = _step_widths(target, store, {"models": models, "widths": list(WIDTHS)})
        costs.seed_widths(widths)
        if choice.widths is not None:
            choice = replace(choice, widths=widths)
    return choice


def _pair_calibration(target, draft, k: int, store: MeasuredStore | None, key: dict) -> Calibration:
    """The target's and the draft's step times: those kept in `store` under `key` at an
    earlier start when trusted, else timed now (and kept there; `draft()` loads the draft
    runner). No store: always timed."""
    found = store.get("pair", key, lambda v: positive_seconds(v, 3)) if store is not None else None
    if found is not None:  # three positive seconds (positive_seconds checked)
        target_1, target_k1, draft_1 = found
        return Calibration(k, target_1, target_k1, draft_1, when="at an earlier start (kept in the cache)")
    cal = calibrate(target, draft(), k)
    if store is not None:
        store.put("pair", key, [cal.target_1, cal.target_k1, cal.draft_1])
    return cal


def _step_widths(target, store: MeasuredStore | None, key: dict) -> dict[int, float]:
    """Seconds of one target step at each of WIDTHS: kept in `store` under `key` when
    trusted, else timed now (and kept there). No store: always timed."""
    found = store.get("widths", key, lambda v: positive_seconds(v, len(WIDTHS))) if store is not None else None
    if found is not None:
        return dict(zip(WIDTHS, found))
    widths = step_costs(target)  # steps, not a line
    if store is not None:
        store.put("widths", key, [widths[w] for w in WIDTHS])
    return widths


def rechecked(rounds, choice: ModeChoice, spec, params, reason: str):
    """`rounds` (an engine.round.Round), watched by a ModeCheck when this is an SD call
    whose mode a CPU calibration chose (the call's `reason` is the choice's, which carries
    the calibration's step costs), else as is. Not for a pinned K at T > 0: a seeded sample
    there must not depend on timing."""
    timing_free = spec.adaptive_k or params.greedy  # K per round follows timing already
    if not choice.widths or reason != choice.reason or spec.mode is not Mode.SD or not timing_free:
        return rounds
    return _Rechecked(rounds, ModeCheck(choice.widths))


class _Rechecked:
    """Rounds that switch to plain steps for the rest of the call once their ModeCheck
    says so, yielding a ModeEvent (the next call starts from the engine's choice again:
    one bad stretch must not rule out SD for good). Each round is timed whole: the time
    spent inside the round's own code, not in whoever consumes its events (the CLI
    printing tokens), so the drafter's upkeep counts against SD as it does in use."""

    def __init__(self, rounds, check: ModeCheck) -> None:
        self.rounds = rounds
        self.check: ModeCheck | None = check  # None once switched to plain steps

    def run(self, index: int):
        events, busy = iter(self.rounds.run(index)), 0.0
        while True:
            t0 = time.perf_counter()
            event = next(events, None)
            busy += time.perf_counter() - t0
            if event is None:
                return
            yield event
            change = None
            if self.check is not None and isinstance(event, RoundEvent):
                change = self.check.round(event, wall_s=busy)
            if change is not None:
                log.info("mode %s: %s", change.mode.value, change.reason)
                self.rounds, self.check = self.rounds.plain(), None  # the same rows, caches, last tokens
                yield ModeEvent(index, change.mode.value, change.reason, change.short)
