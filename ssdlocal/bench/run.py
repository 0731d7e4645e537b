"""Run the benchmark: one Engine for AR / SD / SSD (spec= per call) plus peers, interleaved.

For each batch of prompts every system runs once, the system order rotating from batch
to batch (and repeat to repeat) so drift and order effects hit all systems alike. One
short untimed warm-up generation per system comes first. At temperature 0 every
system's tokens are checked against AR's (exactness.py). Nothing here prints: progress
goes to an optional callback `progress(stage, done, total, label)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ssdlocal.bench.exactness import check_exactness, logit_margin
from ssdlocal.bench.measure import Measurement, from_engine_events
from ssdlocal.bench.peers import KNOWN_PEERS, PeerOptions, PeerSkipped, make_peers
from ssdlocal.bench.prompts import BenchPrompt
from ssdlocal.core.choice import Choice
from ssdlocal.core.config import ADAPTIVE_K_MAX, EngineConfig, Mode, SamplingParams, SpecConfig, SuffixDraft
from ssdlocal.core.errors import UsageError
from ssdlocal.engine.prompts import encode_messages
from ssdlocal.speculation.suffix import SuffixMemory

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int, str], None]


class System(Choice):
    """One of our systems (`--modes`): a decoding mode, SUFFIX (SD with the suffix drafter,
    K chosen per round) or AUTO (the engine's own choice, as `generate` runs)."""

    AR = "ar"
    SD = "sd"
    SSD = "ssd"
    SUFFIX = "suffix"
    AUTO = "auto"

    @property
    def needs_draft(self) -> bool:
        """Whether it drafts with the configured draft (SD, SSD)."""
        return self in (System.SD, System.SSD)


MODES = System.choices()


@dataclass(frozen=True)
class BenchSettings:
    """What the benchmark runs besides the engine config and sampling parameters (`modes`:
    the words are parsed into Systems)."""

    modes: tuple[System, ...] = tuple(System)
    peers: tuple[str, ...] = ()
    batch_size: int = 1
    repeats: int = 1
    chat: bool = True
    warmup_tokens: int = 8
    gguf_target: str | None = None
    gguf_draft: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes or len(set(self.modes)) != len(self.modes):
            raise UsageError(f"bad --modes {','.join(self.modes)!r}", f"a comma list of distinct {', '.join(MODES)}")
        object.__setattr__(self, "modes", tuple(System(m) for m in self.modes))
        bad = [p for p in self.peers if p not in KNOWN_PEERS]
        if bad:
            raise UsageError(f"unknown peer {bad[0]!r}", f"choose from: {', '.join(KNOWN_PEERS)}")
        for name, value in (("batch-size", self.batch_size), ("repeats", self.repeats)):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}", f"use --{name} 1")

    @property
    def needs_draft(self) -> bool:
        return any(m.needs_draft for m in self.modes) or "hf-assisted" in self.peers


def mode_spec(base: SpecConfig, mode: System) -> SpecConfig:
    """The engine's speculation settings for one of our systems: AR drafts nothing; SUFFIX
    is SD with the suffix drafter and K chosen per round; AUTO is the configured spec."""
    if mode is System.AR:
        return SpecConfig(mode=Mode.AR, k=base.k)
    if mode is System.SUFFIX:
        return replace(
            base,
            mode=Mode.SD,
            draft=SuffixDraft(),
            adaptive_k=True,
            k=max(base.k, ADAPTIVE_K_MAX),
            fan_out=None,
            fan_out_miss=None,
        )
    if mode is System.AUTO:
        return base
    return replace(base, mode=Mode(mode.value))


@dataclass
class BenchRun:
    """Everything measured; report.py turns it into results.json / .md / .png."""

    config: EngineConfig
    params: SamplingParams
    settings: BenchSettings
    prompts: list[BenchPrompt]
    batches: list[list[str]]  # prompt ids per batch
    records: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    exactness: dict[str, dict] = field(default_factory=dict)
    systems: list[str] = field(default_factory=list)
    quantization: str | None = None  # the target's weights as loaded (none | int8 | int4)
    wall_s: float = 0.0

    @property
    def target(self) -> str:
        return self.config.target.path

    @property
    def draft(self) -> str | None:
        """The draft for reports: its checkpoint path, "n-gram (prompt lookup)", or None."""
        draft = self.config.spec.draft
        return None if draft.kind == "none" else draft.label


def run_bench(
    config: EngineConfig,
    prompts: list[BenchPrompt],
    settings: BenchSettings,
    params: SamplingParams,
    progress: ProgressFn | None = None,
) -> BenchRun:
    """Load one Engine (and the peers), warm up, run every system on every batch, check
    exactness. Engine and peers are closed before returning."""
    from ssdlocal.engine import Engine

    note = progress or (lambda *a: None)
    started = time.perf_counter()
    if settings.needs_draft and config.spec.draft.kind == "none":
        raise UsageError("SD, SSD and hf-assisted need a draft", "pass --draft PATH or use --modes ar")
    batches = [prompts[i : i + settings.batch_size] for i in range(0, len(prompts), settings.batch_size)]
    run = BenchRun(config, params, settings, prompts, [[p.id for p in b] for b in batches])
    note("load", 0, 1, "loading target and draft")
    peers: list = []
    with Engine(config) as engine:
        run.quantization = getattr(engine.target, "quantization", None)  # torch: the resolved scheme
        try:
            ids = prompt_ids(engine, prompts, settings.chat, params, note)
            if settings.peers:
                note("load", 0, 1, "loading peers")
                opts = PeerOptions(
                    config.target.path,
                    config.draft_model and config.draft_model.path,
                    config.target.dtype,
                    config.target.device,
                    config.spec.k,
                    settings.gguf_target,
                    settings.gguf_draft,
                )
                pad = engine.tokenizer.pad_token_id
                peers, run.skipped = make_peers(
                    settings.peers,
                    opts,
                    engine.eos_ids,
                    min(engine.eos_ids) if pad is None else pad,
                )
            memories = Memories(engine)
            systems = _systems(engine, config.spec, settings, peers, memories)
            if System.SSD in systems and not config.spec.draft.ssd:  # a draft head: SD only, as race leaves SSD out
                del systems[System.SSD]
                run.skipped[System.SSD] = f"skipped: {config.spec.draft.label} drafts between verifications (SD only)"
            _measure_all(run, systems, ids, batches, note, memories)
            if params.greedy and System.AR in run.systems:
                note("exactness", 0, 1, "checking exactness against AR")
                margin_fn = lambda prompt, prefix, toks: logit_margin(
                    engine.runner, prompt, prefix, toks, engine.target.dtype
                )
                run.exactness = check_exactness(run.records, ids, margin_fn)
        finally:
            for peer in peers:
                peer.close()
    run.wall_s = time.perf_counter() - started
    return run


def prompt_ids(engine, prompts: list[BenchPrompt], chat: bool, params: SamplingParams, note) -> dict:
    """Token ids per prompt id. A session's turn n is the conversation of its earlier turns,
    answered by AR (greedy: the answer every exact system gives), plus its own message."""
    ids, said = {}, {}
    for p in sorted(prompts, key=lambda p: (p.session is None, p.session or "", p.turn)):
        if p.session is None:
            ids[p.id] = engine.encode(p.prompt, chat)
            continue
        system = [{"role": "system", "content": p.system}] if p.system else []
        messages = said.setdefault(p.session, system) + [{"role": "user", "content": p.prompt}]
        ids[p.id] = encode_messages(engine.tokenizer, messages)
        note("sessions", 0, 1, f"answering {p.id} (AR) for the next turn's conversation")
        greedy = replace(params, temperature=0.0)
        done = [e for e in engine.generate([ids[p.id]], greedy, spec=SpecConfig(mode=Mode.AR))][-1]
        said[p.session] = messages + [{"role": "assistant", "content": done.outputs[0].text}]
    return ids


def measuring_units(batches: list[list[BenchPrompt]]) -> list[list[tuple[int, list[BenchPrompt]]]]:
    """What one system runs back to back: a batch of single prompts, or a whole session (its
    turns in order, one per batch), so a turn reuses only what its own earlier turns left
    in the caches. Each unit starts cold. Items are (batch index, batch)."""
    units: list[list[tuple[int, list[BenchPrompt]]]] = []
    sessions: dict[str, list[tuple[int, list[BenchPrompt]]]] = {}
    for b, batch in enumerate(batches):
        session = batch[0].session if len(batch) == 1 else None
        if session is None:
            units.append([(b, batch)])
        elif session in sessions:
            sessions[session].append((b, batch))
        else:
            sessions[session] = [(b, batch)]
            units.append(sessions[session])
    for unit in units:
        unit.sort(key=lambda item: item[1][0].turn)
    return units


class Memories:
    """A suffix memory per system: what that system answered earlier in the run (as in use),
    never what another system answered to the same prompt. `reset` empties them all."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.caps = (engine.suffix_memory.max_sequences, engine.suffix_memory.max_tokens)  # as configured
        self.by_system: dict[str, SuffixMemory] = {}

    def use(self, name: str) -> None:
        self.engine.suffix_memory = self.by_system.setdefault(name, SuffixMemory(*self.caps))

    def reset(self) -> None:
        self.by_system.clear()


def _systems(engine, base: SpecConfig, settings: BenchSettings, peers: list, memories: Memories) -> dict[str, Callable]:
    """name -> run(batch_token_ids, params) -> Measurement, in the order the user gave."""
    systems: dict[str, Callable] = {}
    for mode in settings.modes:
        spec = mode_spec(base, mode)
        k = 0 if mode is System.AR else spec.k

        def run_mode(batch, params, fresh=True, _mode=mode, _spec=spec, _k=k) -> Measurement:
            memories.use(_mode)
            if fresh:  # the prompt is read cold: nothing another call left is reused
                engine.forget_prefixes()
            return from_engine_events(_mode, engine.generate(batch, params, spec=_spec), _k)

        systems[mode] = run_mode
    for peer in peers:
        systems[peer.name] = peer.generate
    return systems


def _measure_all(run: BenchRun, systems: dict, ids: dict, batches: list, note: ProgressFn, memories: Memories) -> None:
    settings, params = run.settings, run.params
    warm = replace(params, max_new_tokens=min(settings.warmup_tokens, params.max_new_tokens))
    first = [ids[p.id] for p in batches[0]]
    for i, (name, fn) in enumerate(list(systems.items())):
        note("warmup", i, len(systems), f"warm-up {name}")
        try:
            fn(first, warm, True)
        except PeerSkipped as exc:
            run.skipped[name] = f"skipped: {exc}"
            del systems[name]
    run.systems = list(systems)
    units = measuring_units(batches)
    total = settings.repeats * len(batches) * len(systems)
    done = 0
    for repeat in range(settings.repeats):
        memories.reset()  # the warm-up's and the last repeat's answers are not remembered
        for u, unit in enumerate(units):
            names = list(systems)
            shift = (repeat * len(units) + u) % len(names)
            for order, name in enumerate(names[shift:] + names[:shift]):
                for turn, (b, batch) in enumerate(unit):  # a session's turns in order, on one system
                    note("run", done, total, f"{name} · {', '.join(p.id for p in batch)} · repeat {repeat + 1}")
                    try:
                        m = systems[name]([ids[p.id] for p in batch], params, turn == 0)
                    except PeerSkipped as exc:
                        run.skipped[name] = f"skipped: {exc}"
                        break
                    rec = {
                        "batch": b,
                        "repeat": repeat,
                        "order": order,
                        "prompt_ids": [p.id for p in batch],
                        "session": batch[0].session,
                        "turn": batch[0].turn,
                    }
                    rec.update(m.to_json())
                    run.records.append(rec)
                    done += 1
    note("run", total, total, "done")
    run.systems = [s for s in run.systems if any(r["system"] == s for r in run.records)]
