"""What the race and the chat say beside their numbers, from the engine's config and runs.

- How the three modes are made exact (`exact_config`): on kernels whose logits part with
  the call width (llama.cpp on a CPU, placement/mode.batch_exact) every mode's steps run
  batch-invariant (`ModelSpec.batch_invariant`), so greedy AR, SD and SSD agree token
  for token; the race says so (`exact_form`).
- Where SSD's draft runs (`hardware`): sharing the target's CPU cores or GPU, or on
  hardware of its own; and, when it shares, what `bench --project` expects of SSD with
  hardware of its own (`projected_ssd`: speculation/projection.py at the draft/target
  ratio this race measured).
- Which mode `auto` picks on this machine and why (`auto_choices`): the engine's own
  decision (engine/auto.placement_choice, placement/mode.py), for the settings a user
  gets by default and, where the race changed them, for the race's.
- Why outputs may differ at T=0 (`divergence_cause`); the lines under the table (`footer_lines`).
- For the chat's stats panel: why an answer runs its mode (`answer_reason`) and where the
  draft runs, in short (`draft_place`).
UI-free: no Textual import.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from ssdlocal.core.config import EngineConfig, Mode, normalize_device
from ssdlocal.core.metrics import Metrics
from ssdlocal.core.quantization import DType, Quantization
from ssdlocal.placement.mode import ModeChoice, batch_exact, cpu_shared


def _targets(config: EngineConfig) -> tuple[str, ...]:
    return tuple(map(normalize_device, config.target_devices or (config.target.device,)))


def exact_config(config: EngineConfig) -> EngineConfig:
    """`config` with batch-invariant steps where the target's kernels give a token other
    logits in a call of several tokens than alone; unchanged elsewhere."""
    target = config.target
    if batch_exact(target.backend, _targets(config), target.batch_invariant):
        return config
    return replace(config, target=replace(target, batch_invariant=True))


def exact_form(config: EngineConfig) -> str | None:
    """How this race keeps greedy outputs identical, when it takes a step of its own."""
    if not config.target.batch_invariant:
        return None
    return (
        "exact: every mode's steps are batch-invariant (--batch-invariant): llama.cpp's CPU kernels give a "
        "token other logits in a call of several tokens than alone, so each call here uses one kernel family "
        "and greedy AR, SD and SSD agree token for token (a plain step costs more than llama.cpp's default: "
        "docs/benchmarks.md)"
    )


def _cores() -> int:
    return os.cpu_count() or 1


def _cpus(cpus: Sequence[int]) -> str:
    cpus = list(cpus)
    if len(cpus) > 2 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def hardware(config: EngineConfig) -> tuple[bool, str]:
    """(whether SSD's draft shares the target's hardware, the sentence that says where it runs)."""
    draft = config.draft_model
    if draft is None:
        return False, f"the {config.spec.draft.label} draft is no model: it costs nothing to run"
    targets, where = _targets(config), normalize_device(draft.device)
    if where == "cpu" and "cpu" in targets:
        cores = _cores()
        split = None
        if config.pin_cpus:
            from ssdlocal.placement.cpus import split_cpus

            split = split_cpus()
        cut = f" (target {_cpus(split.target_cpus)}, draft {_cpus(split.draft_cpus)})" if split else ""
        return True, f"its draft shares the target's CPU: SSD splits its {cores} cores{cut} and one memory system"
    if where in targets:
        return True, f"its draft shares {where} with the target"
    return False, f"its draft has hardware of its own ({where}; target on {','.join(targets)})"


def draft_place(config: EngineConfig) -> str:
    """Where the draft runs, for a 20-column cell: `shares the CPU`, `own: cuda:1`."""
    draft = config.draft_model
    if draft is None:
        return "no model" if config.spec.draft.kind != "none" else "none"
    where = normalize_device(draft.device)
    return f"shares {'the CPU' if where == 'cpu' else where}" if where in _targets(config) else f"own: {where}"


def answer_reason(config: EngineConfig, mode: Mode, auto: ModeChoice | None) -> str:
    """Why an answer runs `mode` (the engine's reason): auto's choice, or a mode picked in
    the chat beside what auto picks; on kernels whose logits part with the call width,
    what speculating there costs in exactness."""
    if auto is not None and auto.mode is mode:
        why = f"auto: {auto.short or auto.reason}"
    else:
        picked = f"{mode.value.upper()} picked in the chat (F2, /mode)"
        why = f"{picked}; auto picks {auto.mode.value.upper()}: {auto.short or auto.reason}" if auto else picked
    target = config.target
    if mode is not Mode.AR and not batch_exact(target.backend, _targets(config), target.batch_invariant):
        why += "; on llama.cpp's CPU kernels greedy SD/SSD is exact up to near-ties (--batch-invariant: exact)"
    return why


def auto_choices(config: EngineConfig, default: EngineConfig | None = None) -> list[tuple[str, ModeChoice | None]]:
    """[(for whom, choice)]: what `--mode auto` runs with `default` (the settings a user
    gets without the race's changes) and, when that differs, with the race's `config`;
    None where a calibration of the loaded models decides at start (K pinned, target and
    draft sharing the CPU)."""
    out: list[tuple[str, ModeChoice | None]] = []
    for who, cfg in (("", default or config), ("with --batch-invariant, as this race runs", config)):
        choice = _auto(cfg)
        if not out or _said(choice) != _said(out[0][1]):
            out.append((who, choice))
    return out


def _said(choice: ModeChoice | None) -> str:
    if choice is None:
        return "a calibration of the loaded models at start picks AR or SD (target and draft share the CPU)"
    return choice.line


def _auto(config: EngineConfig) -> ModeChoice | None:
    from ssdlocal.engine.auto import placement_choice

    choice = placement_choice(replace(config, spec=replace(config.spec, mode=Mode.AUTO)))
    return choice if choice is not None else cpu_shared(config.spec.adaptive_k)


def divergence_cause(config: EngineConfig) -> str:
    """The known cause when a greedy mode's tokens leave AR's, for these kernels."""
    target = config.target
    if not batch_exact(target.backend, _targets(config), target.batch_invariant):
        return (
            "llama.cpp's CPU kernels give a token other logits in a call of several tokens than alone, "
            "so a near-tie between the top two tokens can turn (--batch-invariant makes the modes identical)"
        )
    if not target.backend.runs_gguf and (
        target.dtype is not DType.FLOAT32 or target.quantization is not Quantization.NONE
    ):
        return (
            f"a near-tie in {target.dtype}: a forward over K+1 tokens rounds differently from one over 1 token "
            "(in float32 the modes are identical; `ssdlocal check` shows the target's margin there)"
        )
    return "no known cause on these kernels (their steps are exact at every width): run `ssdlocal check` and report it"


def projected_ssd(
    ar: Metrics | None, sd: Metrics | None, ssd: Metrics | None, k: int, costs=None
) -> tuple[float, float] | None:
    """(SSD's speedup over AR that `bench --project` projects with the draft on hardware
    of its own, the draft/target step ratio it is projected at), with SSD's measured hit
    rate and tokens per round (speculation/projection.py). The ratio is the draft model's
    time per token alone on the machine over AR's step: SD's draft time per drafted token
    when every SD proposal came from the model (K pinned), else the engine's measured cost
    of a draft token (`costs`: speculation/adaptive.CostModel, `Engine.costs`), since SD
    choosing per round also proposes from the suffix index, which costs nothing. None when
    neither timed the draft model or a mode did not run."""
    from ssdlocal.speculation.projection import ProjectionInputs, project

    if ar is None or sd is None or ssd is None or ssd.ssd is None or not ar.verify_ms_per_round:
        return None
    if sd.adaptive is None:
        drafted = k * sd.rounds
        per_token_ms = sd.draft_ms / drafted if drafted and sd.draft_ms else None
    else:
        seconds = getattr(costs, "draft_token_s", None)
        per_token_ms = seconds * 1e3 if seconds else None
    if per_token_ms is None:
        return None
    ratio = per_token_ms / ar.verify_ms_per_round
    backups = ssd.ssd.backup_used
    misses = sum(backups.values())
    inputs = ProjectionInputs(
        k=k,
        e_sd=sd.mean_accepted_len,
        p_hit=ssd.cache_hit_rate,
        e_hit=ssd.ssd.tokens_per_round_hit,
        e_miss=ssd.ssd.tokens_per_round_miss,
        backup_forwards=k * backups.get("jit", 0) / misses if misses else float(k),
        measured_ratio=ratio,
    )
    row = next(r for r in project(inputs, ratios=())["rows"] if r["measured"])
    return (row["ssd_speedup"], ratio) if row["ssd_speedup"] is not None else None


def ssd_note(config: EngineConfig, runs: Sequence | None = None, *, short: bool = False, costs=None) -> str:
    """The SSD pane's note: where its draft runs; once the modes have run and the draft
    shares the target's hardware, what `bench --project` expects with hardware of its own
    (`short`: the few lines a pane has; `costs`: the engine's measured step costs)."""
    if not config.spec.draft.ssd:
        return (
            f"not raced: the {config.spec.draft.label} drafts in SD only (it reads the hidden state of the "
            "token it continues, which exists once the target has verified it; SSD needs a draft model)"
        )
    shares, where = hardware(config)
    if short and shares and normalize_device(config.draft_model.device) == "cpu":  # type: ignore[union-attr]
        where = f"draft shares the target's {_cores()} CPU cores"
    if not shares or not runs:
        return where
    stats = {r.mode: r.stats for r in runs}
    found = projected_ssd(stats.get(Mode.AR), stats.get(Mode.SD), stats.get(Mode.SSD), config.spec.k, costs)
    if found is None:
        return f"{where}; no projection for hardware of its own (the draft model's speed alone was not timed)"
    speedup, ratio = found
    if short:
        return f"{where}; own hardware: {speedup:.2f}× AR projected (bench --project, draft/target {ratio:.2f})"
    return (
        f"{where}; with hardware of its own `bench --project` expects {speedup:.2f}× AR "
        f"(projected at draft/target {ratio:.2f}, not measured)"
    )


def footer_lines(rows: Sequence, config: EngineConfig, default: EngineConfig | None, greedy: bool) -> list[str]:
    """The lines under the race's table: outputs (with the known cause when they differ),
    how the modes were made exact, whether other load disturbed the timings, and what
    `auto` picks here and why."""
    from ssdlocal.tui.race import identical_verdict, timing_note

    lines = [identical_verdict(rows, greedy, divergence_cause(config))]
    lines.append(exact_form(config) or "")
    lines.append(timing_note(rows))
    if not config.spec.draft.ssd:  # no SSD pane: say why here
        lines.append(f"SSD: {ssd_note(config)}")
    said = [f"{who}: {_said(choice)}" if who else _said(choice) for who, choice in auto_choices(config, default)]
    lines.append("auto here: " + "; ".join(said))
    return [line for line in lines if line]
