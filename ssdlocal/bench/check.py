"""`ssdlocal check`: prove greedy SD and SSD reproduce AR token for token on this machine.

One Engine (loaded for SSD, so its draft worker starts once) runs a few built-in
prompts greedily in AR, SD and SSD via `generate(..., spec=)`. Any divergence is
reported with its position and the target's logit margin (top1 - top2) there, so a
bf16/fp16 near-tie can be told from a bug; in fp32 outputs must be identical, but for a
llama.cpp target without --batch-invariant, whose kernels round a verification of K+1
tokens differently from a lone token (`CheckReport.shape_rounding`).
Knows nothing about terminals: the CLI renders the CheckReport.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ssdlocal.core.config import EngineConfig, Mode, SamplingParams
from ssdlocal.core.events import DoneEvent
from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import DType

PROMPTS = (
    "def fibonacci(n):",
    "The three most important ideas in computer science are",
    "Write a short poem about the sea.",
)
MODES = (Mode.AR, Mode.SD, Mode.SSD)
NEAR_TIE = 0.5  # logits: a divergence with a smaller target margin is likely numerical
SHAPE_TIE = 1.0  # logits: llama.cpp's call widths move a logit by up to ~0.5 (1.5B Q4_K_M)


@dataclass(frozen=True)
class ModeRun:
    mode: Mode  # a string is parsed
    token_ids: tuple[tuple[int, ...], ...]  # per prompt
    tokens: int
    decode_tokens: float  # tokens emitted after the first one (prefill excluded)
    decode_s: float
    wall_s: float
    acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Divergence:
    mode: Mode  # a string is parsed
    prompt_index: int
    position: int  # index into the generated tokens
    ar_token: int | None
    mode_token: int | None
    margin: float | None  # target's top1 - top2 logit at that position

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and self.margin < NEAR_TIE


@dataclass(frozen=True)
class CheckReport:
    dtype: DType  # a string is parsed
    prompts: tuple[str, ...]
    runs: tuple[ModeRun, ...]
    divergences: tuple[Divergence, ...]
    warnings: tuple[str, ...] = ()
    shape_rounding: bool = False  # a llama.cpp target without --batch-invariant

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype, "dtype"))

    @property
    def identical(self) -> bool:
        return not self.divergences

    def run(self, mode: str) -> ModeRun:
        return next(r for r in self.runs if r.mode == mode)


def target_margin(engine, prompt_ids: Sequence[int], prefix: Sequence[int]) -> float:
    """top1 - top2 of the target's logits after `prompt_ids + prefix` (one fresh forward)."""
    from ssdlocal.bench.exactness import logit_margin  # torch: lazy

    return logit_margin(engine.runner, prompt_ids, prefix)["margin"]


def _run_mode(engine, mode: Mode, config: EngineConfig, prompts, params, chat) -> ModeRun:
    spec = dataclasses.replace(config.spec, mode=mode)
    ids, tokens, decode_tokens, decode_s, accepted, drafted = [], 0, 0.0, 0.0, 0.0, 0
    t0 = time.perf_counter()
    for prompt in prompts:  # one at a time: batch size 1, as in interactive use
        done = None
        engine.forget_prefixes()  # every mode reads each prompt the same way (no other mode's KV)
        for event in engine.generate([prompt], params, chat=chat, spec=spec):
            if isinstance(event, DoneEvent):
                done = event
        out, stats = done.outputs[0], done.stats
        ids.append(tuple(out.token_ids))
        tokens += len(out.token_ids)
        decode_s += stats.decode_s
        decode_tokens += stats.decode_tokens if stats.tokens_per_s else 0  # prefill excluded; none without decode time
        if stats.acceptance_rate is not None:
            weight = max(1, stats.rounds)
            accepted += stats.acceptance_rate * weight
            drafted += weight
    wall = time.perf_counter() - t0
    return ModeRun(
        mode,
        tuple(ids),
        tokens,
        decode_tokens,
        decode_s,
        wall,
        accepted / drafted if drafted else None,
    )


def run_check(
    config: EngineConfig,
    prompts: Sequence[str] = PROMPTS,
    params: SamplingParams | None = None,
    *,
    chat: bool = False,
    modes: Sequence[Mode] = MODES,
    engine_factory: Callable | None = None,
    on_mode: Callable[[str], None] | None = None,
) -> CheckReport:
    """Run every mode greedily on `prompts` with one engine and compare with AR."""
    from ssdlocal.bench.exactness import divergence_index

    if engine_factory is None:
        from ssdlocal.engine import Engine as engine_factory
    params = params or SamplingParams(max_new_tokens=32)
    params = dataclasses.replace(params, temperature=0.0)
    runs: dict[Mode, ModeRun] = {}
    divergences: list[Divergence] = []
    with engine_factory(config) as engine:
        for mode in modes:
            if on_mode:
                on_mode(mode.value)
            runs[mode] = _run_mode(engine, mode, config, prompts, params, chat)
        reference = runs.get(Mode.AR)
        for mode, run in runs.items():
            if reference is None or mode is Mode.AR:
                continue
            for i, (want, got) in enumerate(zip(reference.token_ids, run.token_ids)):
                pos = divergence_index(want, got)
                if pos is None:
                    continue
                margin = target_margin(engine, engine.encode(prompts[i], chat), want[:pos])
                divergences.append(
                    Divergence(
                        mode,
                        i,
                        pos,
                        want[pos] if pos < len(want) else None,
                        got[pos] if pos < len(got) else None,
                        margin,
                    )
                )
    target = config.target
    shapes = target.backend is BackendName.LLAMACPP and not target.batch_invariant
    return CheckReport(target.dtype, tuple(prompts), tuple(runs.values()), tuple(divergences), shape_rounding=shapes)
