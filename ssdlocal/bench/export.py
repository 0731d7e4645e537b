"""`ssdlocal export`: the settings that serve a pair the same way on another engine.

`export_settings` decides, and says where each came from: the models (Hugging Face ids or
local paths for vLLM and SGLang; GGUF files for llama.cpp's `llama-server`), the number of
speculative tokens K (given; measured: the K the fastest exact speculative system of a
`bench` results.json ran at, its mean where K was chosen per round; or the pair's
suggested K), the tensor-parallel size and the devices of the placement plan
(placement/planner.py, for this machine or for `--gpus N --gpu-memory GB`), and the context
(given, or both models' own, as `serve` fills it). `export_engines.export` turns them into
each engine's command line and config file. Knows nothing of the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.choice import Choice
from ssdlocal.core.errors import SSDLocalError, UsageError
from ssdlocal.core.metrics import Counts, Metrics
from ssdlocal.core.models import BackendName
from ssdlocal.core.quantization import Quantization
from ssdlocal.placement.inventory import GPU, DeviceInventory
from ssdlocal.placement.planner import Plan, plan_placement
from ssdlocal.weights.pairs import GGUFRef, ModelRef, Pair

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # `ssdlocal serve`'s: clients keep their base URL


class Engine(Choice):
    """An engine a pair can move to."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMA_SERVER = "llama-server"

    @property
    def runs_gguf(self) -> bool:
        """Whether it serves the pair's GGUF files (else the Hugging Face checkpoints)."""
        return self is Engine.LLAMA_SERVER


@dataclass(frozen=True)
class Sourced:
    """A setting and where it came from (printed with it)."""

    value: object
    source: str


@dataclass(frozen=True)
class ExportRequest:
    """What was asked of an export besides the engine and the pair: K (and where it came
    from), and where given the context, the tensor-parallel size and the name clients send
    (None: the models' own, the placement plan's, the pair's), and the engine's address."""

    k: Sourced  # int
    context: int | None = None
    tensor_parallel: int | None = None
    served_name: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT


@dataclass(frozen=True)
class ExportSettings:
    """What the exported command serves, resolved for one engine."""

    engine: Engine
    pair: str
    target: str  # a Hugging Face id, a local path, or a GGUF file / `repo:quant` (llama-server)
    draft: str
    local_files: bool  # target / draft are files on this machine (else the engine downloads them)
    k: Sourced  # int
    tensor_parallel: Sourced  # int
    context: Sourced  # int | None: None leaves the engine's default (the model's own)
    plan: Plan
    layers: tuple[int | None, int | None]  # target's and draft's layer counts, where the pair says
    served_name: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    head: str | None = None  # the kind of the pair's draft head (weights.formats.archs.HEADS), None: a draft model


# ---------------------------------------------------------------------- K
def measured_k(doc: dict, origin: str = "the benchmark") -> Sourced:
    """K from a `bench` results.json: the K of its fastest speculative system that passed
    the exactness check (the mean K of its rounds, rounded, where K was chosen per round)."""
    aggregates = doc.get("aggregates") if isinstance(doc, dict) else None
    if not isinstance(aggregates, dict):
        raise UsageError(f"{origin} is no `ssdlocal bench` results.json", "pass the results.json a bench run wrote")
    ran = [
        (agg.get("tokens_per_s") or 0.0, name)
        for name, agg in aggregates.items()
        if isinstance(agg, dict) and (agg.get("k") or 0) > 0 and agg.get("valid", True)
    ]
    if not ran:
        raise UsageError(
            f"{origin} ran no exact speculative system (no K was measured)",
            "bench SD or SSD (`ssdlocal bench --modes ar,sd`), or give the number: --k 4",
        )
    _, system = max(ran)
    agg = aggregates[system]
    specs = [r["spec"] for r in doc.get("records", ()) if r.get("system") == system and r.get("spec")]
    mean_k = Metrics.of(sum((Counts.from_dict(s) for s in specs), Counts(k=agg["k"]))).mean_k if specs else None
    k = max(1, round(mean_k)) if mean_k is not None else int(agg["k"])
    how = f"mean K {mean_k:.2f} of its rounds" if mean_k is not None else f"K={agg['k']}"
    rate = agg.get("acceptance_rate")
    accepted = f", {rate:.0%} of drafts accepted" if rate is not None else ""
    speedup = agg.get("speedup_vs_ar")
    versus = f", {speedup:.2f}x AR" if speedup is not None else ""
    return Sourced(k, f"measured: {system} in {origin} ({how}{accepted}{versus})")


def read_bench(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", "pass the results.json a bench run wrote") from None
    except ValueError:
        raise UsageError(f"{path} is not JSON", "pass the results.json a bench run wrote") from None


# ---------------------------------------------------------------------- placement
def destination(gpus: int | None, gpu_memory_gb: float | None, here: DeviceInventory) -> DeviceInventory:
    """The machine to plan for: this one, or `gpus` GPUs of `gpu_memory_gb` each (with this
    machine's cores and RAM)."""
    if gpus is None and gpu_memory_gb is None:
        return here
    if gpus is None or gpu_memory_gb is None or gpus < 1 or not gpu_memory_gb > 0:
        raise UsageError(
            "--gpus and --gpu-memory describe the machine to plan for together (a count >= 1 and GB > 0)",
            "e.g. --gpus 2 --gpu-memory 80",
        )
    cards = tuple(GPU(i, "planned", float(gpu_memory_gb)) for i in range(gpus))
    return DeviceInventory(cards, here.cpu_cores, here.ram_gb, here.ram_available_gb, "unknown")


def _heads(ref: ModelRef) -> tuple[int, ...]:
    return tuple(h for h in (ref.heads, ref.kv_heads) if h)


# ---------------------------------------------------------------------- models
def _hub_model(ref: ModelRef, role: str, pair: Pair) -> tuple[str, bool]:
    """A checkpoint vLLM / SGLang load: a local path (source "local"), else the repo id."""
    if ref.path:
        return str(Path(ref.path).expanduser()), True
    if ref.repo:
        return ref.repo, False
    raise UsageError(
        f"the pair {pair.name} names no Hugging Face repository for its {role}",
        f'add `repo = "ORG/NAME"` to the [{role}] table of {pair.file or "the pair file"}',
    )


def _gguf_model(ref: GGUFRef | None, found: str | None, role: str, pair: Pair) -> tuple[str, bool]:
    """A GGUF llama-server loads: the file on this machine, else `repo:quant` (-hf)."""
    if found is not None:
        return found, True
    if ref is not None and ref.repo:
        return f"{ref.repo}:{ref.quant}" if ref.quant else ref.repo, False
    raise UsageError(
        f"the {role} GGUF file of {pair.name} is not on this machine and has no repository to name",
        f"fetch it first: ssdlocal pull {pair.name} --backend llamacpp",
    )


def export_settings(
    engine: Engine,
    pair: Pair,
    inventory: DeviceInventory,
    asked: ExportRequest,
    gguf_files: tuple[str, str] | None = None,
    contexts: tuple[int | None, int | None] = (None, None),
) -> ExportSettings:
    """The settings for `engine`. `gguf_files`: the pair's GGUF files on this machine (None:
    not fetched); `contexts`: the target's and draft's own contexts where known (their GGUF
    headers); the context and tensor-parallel size `asked` override what those and the plan give."""
    k, context, tensor_parallel = asked.k, asked.context, asked.tensor_parallel
    if not 1 <= int(k.value) <= 64:
        raise UsageError(f"K must be in 1..64, got {k.value}", "e.g. --k 4")
    if pair.draft_head is not None and engine.runs_gguf:
        raise UsageError(
            f"pair {pair.name} drafts with a {pair.draft_head} draft head, which {engine} does not run",
            "export it to vllm or sglang (--to vllm), which run such heads beside the target",
        )
    backend = BackendName.LLAMACPP if engine.runs_gguf else BackendName.TORCH
    t_gb, d_gb = pair.memory_gb(backend, Quantization.NONE)
    try:
        beside = pair.draft_head is not None  # a head shares the target's GPU
        plan = plan_placement(inventory, t_gb, d_gb, heads=_heads(pair.target), draft_beside=beside)
    except SSDLocalError as exc:
        raise UsageError(
            f"the pair {pair.name} does not fit the machine planned for: {exc.message}",
            "plan for the machine you move to: --gpus N --gpu-memory GB",
        ) from None
    tp = Sourced(plan.tensor_parallel, f"the placement plan ({_plan_words(plan)})")
    if tensor_parallel is not None:
        if tensor_parallel < 1:
            raise UsageError(f"tensor-parallel must be >= 1, got {tensor_parallel}", "e.g. --tensor-parallel 2")
        tp = Sourced(tensor_parallel, "given")
    known = [c for c in contexts if c]
    ctx = Sourced(min(known), "both models' own (as `ssdlocal serve` fills it)") if known else Sourced(None, "")
    if context is not None:
        if context < 16:
            raise UsageError(f"context must be at least 16 tokens, got {context}", "e.g. --context 32768")
        ctx = Sourced(context, "given")
    if engine.runs_gguf:
        (target, local_t), (draft, local_d) = (
            _gguf_model(ref, found, role, pair)
            for ref, found, role in zip(
                (pair.gguf_target, pair.gguf_draft), gguf_files or (None, None), ("target", "draft")
            )
        )
    else:
        (target, local_t), (draft, local_d) = (
            _hub_model(ref, role, pair) for ref, role in ((pair.target, "target"), (pair.draft, "draft"))
        )
    return ExportSettings(
        engine,
        pair.name,
        target,
        draft,
        local_t and local_d,
        k,
        tp,
        ctx,
        plan,
        (pair.target.layers, pair.draft.layers),
        asked.served_name or pair.name,
        asked.host,
        asked.port,
        pair.draft_head,
    )


def _plan_words(plan: Plan) -> str:
    target = ",".join(plan.target_devices)
    return f"target {target}, draft {plan.draft_where}"
