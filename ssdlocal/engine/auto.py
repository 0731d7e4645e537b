"""`--mode auto`: which exact mode runs fastest on this placement, and why (one sentence).

Placement decides most cases before anything loads: no draft -> AR; an n-gram draft ->
SD (its proposals cost nothing); a draft on hardware of its own (another GPU, or the
CPU beside a GPU target) -> SSD, whose drafting then overlaps verification; target and
draft on one GPU -> SD. Target and draft both on the CPU share one memory system, where
SSD would split the cores and lose to SD, so a short calibration times the loaded
models (target forward at 1 and K+1 tokens, draft forward at 1 token) and predicts
whether SD beats AR.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ssdlocal.core.config import EngineConfig, Mode, normalize_device

PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before anything was generated
CALIBRATION_PROMPT = 16  # tokens of context the timed forwards attend to
REPEATS = 5


@dataclass(frozen=True)
class ModeChoice:
    mode: Mode
    reason: str


@dataclass(frozen=True)
class Calibration:
    """Median seconds of one forward: target at 1 and at K+1 tokens, draft at 1 token."""

    k: int
    target_1: float
    target_k1: float
    draft_1: float

    def predicted(self, acceptance: float = PRIOR_ACCEPTANCE) -> tuple[float, float]:
        """(AR, SD) tokens per second: AR makes one token per target forward; an SD round
        costs K draft forwards and one K+1-token verify and yields E tokens on average."""
        a, k = acceptance, self.k
        tokens_per_round = (1 - a ** (k + 1)) / (1 - a)  # E[accepted] + 1 for capped geometric
        return 1.0 / self.target_1, tokens_per_round / (k * self.draft_1 + self.target_k1)


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def placement_choice(config: EngineConfig) -> ModeChoice | None:
    """The mode the placement alone decides, or None when only a calibration can."""
    spec = config.spec
    if spec.draft.model is None:
        if spec.draft.kind == "none":
            return ModeChoice(Mode.AR, "no draft model, so plain autoregressive decoding")
        return ModeChoice(Mode.SD, f"the {spec.draft.label} draft costs nothing to run, so synchronous speculation")
    targets = tuple(map(normalize_device, config.target_devices or (config.target.device,)))
    draft = normalize_device(config.draft_model.device)
    where = ",".join(targets)
    if draft not in targets and (_is_gpu(draft) or any(_is_gpu(t) for t in targets)):
        return ModeChoice(
            Mode.SSD,
            f"the draft has hardware of its own ({draft}, target on {where}), so SSD "
            "pre-speculates while the target verifies",
        )
    if _is_gpu(draft):
        return ModeChoice(
            Mode.SD,
            f"target and draft share {draft}, so drafting cannot overlap verification: "
            "synchronous speculation",
        )
    return None


def calibrate(target, draft, k: int) -> Calibration:
    """Time the loaded runners (their caches are reset: call between generations)."""
    return Calibration(k, _time_steps(target, 1), _time_steps(target, k + 1), _time_steps(draft, 1))


WIDTHS = (1, 2, 3, 4, 5, 8, 9, 12, 13)  # CPU kernels take rows in blocks (of 4): costs step


def step_costs(runner, widths=WIDTHS, repeats: int = 2) -> dict[int, float]:
    """Seconds of one target step at each width (the adaptive K's cost model starts from
    these on a CPU, where a step's cost rises in blocks of rows rather than smoothly)."""
    return {w: _time_steps(runner, w, repeats) for w in widths}


def _time_steps(runner, width: int, repeats: int = REPEATS) -> float:
    runner.reset(1, CALIBRATION_PROMPT + width + 2)
    runner.feed([list(range(1, CALIBRATION_PROMPT + 1))], "none")
    runner.begin_steps()
    ids = torch.ones(1, width, dtype=torch.long, device=runner.device)
    runner.step(ids)  # warm-up (first-call allocations)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.step(ids).sum().item()  # .item(): wait for the device
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: the cost without other load


def calibrated_choice(cal: Calibration, adaptive_k: bool = False) -> ModeChoice:
    """AR or SD for a target and draft sharing the CPU, from measured forward costs; with
    adaptive K, SD, which keeps choosing per round (a plain step when drafting does not pay)."""
    if adaptive_k:
        return ModeChoice(
            Mode.SD,
            f"target and draft share the CPU (SSD would split its cores); measured target "
            f"{cal.target_1 * 1e3:.0f} ms/token and {cal.target_k1 * 1e3:.0f} ms per "
            f"{cal.k + 1}-token verify, draft {cal.draft_1 * 1e3:.0f} ms/token: SD choosing K "
            "each round from these costs and the acceptance so far (K=0, a plain step, when "
            "no proposal pays)",
        )
    ar, sd = cal.predicted()
    mode = Mode.SD if sd > ar else Mode.AR
    return ModeChoice(
        mode,
        f"target and draft share the CPU (SSD would split its cores); measured target "
        f"{cal.target_1 * 1e3:.0f} ms/token and {cal.target_k1 * 1e3:.0f} ms per "
        f"{cal.k + 1}-token verify, draft {cal.draft_1 * 1e3:.0f} ms/token: predicted "
        f"AR {ar:.1f} vs SD {sd:.1f} tok/s at {PRIOR_ACCEPTANCE:.0%} acceptance",
    )
