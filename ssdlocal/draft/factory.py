"""The drafter for one generate call, chosen by the draft's type (core.models.Draft).

`BUILDERS` maps each Draft type to the function that builds its drafter; a new kind of
draft adds its drafter module and one entry here. What a drafter may need from the engine
that runs it (the draft model loaded in this process, the SSD worker) comes through
`DraftResources`, so this module owns no processes or models itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
from ssdlocal.core.models import ModelDraft, NgramDraft, SuffixDraft


@dataclass(frozen=True)
class DraftResources:
    """What the engine offers a drafter for one call."""

    target_vocab: int
    target_device: object  # torch.device where the target verifies
    target_device_name: str  # rank 0 of the target, as configured ("cpu", "cuda:N")
    batch: int
    num_slots: int  # the target's main slots per row (SlotLayout.for_generation)
    draft_runner: Callable[[], object]  # the draft model in this process (loaded on demand)
    worker: Callable[[], object]  # the SSD draft worker (started on demand)
    memory: object = None  # speculation.suffix.SuffixMemory: the engine's, across calls
    costs: object = None  # speculation.adaptive.CostModel: the engine's, across calls
    rates: dict | None = None  # acceptance by source, the engine's, across calls (Acceptance.shared)


def _ngram(spec: SpecConfig, params: SamplingParams, res: DraftResources):
    from ssdlocal.draft.sync import NgramDrafter

    return NgramDrafter(spec.k, spec.draft, res.target_device)


def _adaptive(spec: SpecConfig, params: SamplingParams, res: DraftResources, model, suffix):
    from ssdlocal.draft.adaptive import AdaptiveDrafter
    from ssdlocal.draft.suffix import SuffixSource

    memory = res.memory if suffix is not None and suffix.use_memory else None
    source = None if suffix is None else SuffixSource(memory, suffix.min_confidence)
    return AdaptiveDrafter(model, source, k=spec.k, pinned=not spec.adaptive_k, params=params,
                           costs=res.costs, target_vocab=res.target_vocab, device=res.target_device,
                           shared_rates=res.rates)  # fmt: skip


def _suffix(spec: SpecConfig, params: SamplingParams, res: DraftResources):
    return _adaptive(spec, params, res, None, spec.draft)


def _model(spec: SpecConfig, params: SamplingParams, res: DraftResources):
    if spec.mode is Mode.SD:
        from ssdlocal.draft.sync import ModelDrafter

        drafter = ModelDrafter(res.draft_runner(), spec.k, params, res.target_vocab, res.target_device)
        drafter.reserve(res.batch, res.num_slots)
        return _adaptive(spec, params, res, drafter, spec.draft.suffix)
    from ssdlocal.draft.ssd.client import SSDDrafter

    return SSDDrafter(res.worker(), spec, params, res.target_vocab, res.num_slots,
                      target_device=res.target_device_name, draft_device=spec.draft.model.device,
                      memory=res.memory)  # fmt: skip


BUILDERS: dict[type, Callable] = {NgramDraft: _ngram, SuffixDraft: _suffix, ModelDraft: _model}


def make_drafter(spec: SpecConfig, params: SamplingParams, resources: DraftResources):
    """The drafter of a speculative call (`spec.mode` SD or SSD); None for AR."""
    if spec.mode is Mode.AR:
        return None
    build = BUILDERS.get(type(spec.draft))
    if build is None:
        raise ValueError(f"no drafter for {type(spec.draft).__name__}")  # NoDraft: config validation refuses it
    return build(spec, params, resources)
