"""The drafter for one generate call, built by the function its draft's type names.

Each Draft type (core.models) says which "module:function" builds its drafter; this module
imports it when a call needs it and holds the builder of model drafts (SD in this process,
SSD in the worker). What a drafter may need from the engine (the draft model loaded here,
the SSD worker, the suffix memory, the cost model) comes through draft.base.DraftResources,
so no drafter owns processes or engine state itself.
"""

from __future__ import annotations

import importlib

from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
from ssdlocal.core.models import ModelDraft
from ssdlocal.draft.base import DraftResources


def build_model(spec: SpecConfig, params: SamplingParams, res: DraftResources):
    """A draft model: in this process for SD (adaptive: with the suffix proposals the draft
    asks for), the worker process for SSD."""
    draft = spec.draft
    if not isinstance(draft, ModelDraft):  # ModelDraft names this builder; no other type does
        raise TypeError(f"build_model builds model drafts, not {type(draft).__name__}")
    if spec.mode is Mode.SD:
        from ssdlocal.draft.adaptive import build_adaptive
        from ssdlocal.draft.sync import ModelDrafter

        drafter = ModelDrafter(res.draft_runner(), spec.k, params, res.target_vocab, res.target_device,
                               guides=res.guides, audit=res.audit)  # fmt: skip
        drafter.reserve(res.batch, res.num_slots)
        return build_adaptive(spec, params, res, drafter, draft.suffix)
    from ssdlocal.draft.ssd.client import SSDDrafter

    return SSDDrafter(res.worker(), spec, params, res.target_vocab, res.num_slots,
                      target_device=res.target_device_name, draft_device=draft.model.device,
                      memory=res.memory, audit=res.audit)  # fmt: skip


def make_drafter(spec: SpecConfig, params: SamplingParams, resources: DraftResources):
    """The drafter of a speculative call (`spec.mode` SD or SSD); None for AR. The draft's
    type names its builder (core.models: `builder`, "module:function")."""
    if spec.mode is Mode.AR:
        return None
    if not spec.draft.builder:
        raise ValueError(f"no drafter for {type(spec.draft).__name__}")  # NoDraft: config validation refuses it
    module, _, name = spec.draft.builder.partition(":")
    return getattr(importlib.import_module(module), name)(spec, params, resources)
