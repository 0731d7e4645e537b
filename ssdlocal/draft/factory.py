"""The drafter for one generate call, built by its draft type's row in BUILDERS.

BUILDERS maps each Draft type (core.models) to the function that builds its drafter; the
draft types themselves know no drafter. This module holds the builder of model drafts (SD
in this process, SSD in the worker). What a drafter may need from the engine (the draft
model loaded here, the SSD worker, the suffix memory, the cost model) comes through
draft.base.DraftResources, so no drafter owns processes or engine state itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
from ssdlocal.core.models import HeadDraft, ModelDraft, NgramDraft, SuffixDraft
from ssdlocal.draft.adaptive import build_suffix
from ssdlocal.draft.base import DraftResources
from ssdlocal.draft.head import build_head
from ssdlocal.draft.sync import build_ngram


def build_model(spec: SpecConfig, params: SamplingParams, res: DraftResources):
    """A draft model: in this process for SD (adaptive: with the suffix proposals the draft
    asks for; each row drawn with its own sampling settings), the worker process for SSD
    (one setting per batch: `params`). An adaptive SD call whose measured costs say the
    model cannot pay at any acceptance (speculation.adaptive.model_cannot_pay) drafts from
    the suffix proposals alone, so a draft model not loaded yet stays unloaded."""
    draft = spec.draft
    if not isinstance(draft, ModelDraft):  # ModelDraft names this builder; no other type does
        raise TypeError(f"build_model builds model drafts, not {type(draft).__name__}")
    if spec.mode is Mode.SD:
        from ssdlocal.draft.adaptive import build_adaptive
        from ssdlocal.draft.decode import Drafting
        from ssdlocal.draft.sync import ModelDrafter
        from ssdlocal.speculation.adaptive import model_cannot_pay

        if spec.adaptive_k and res.costs is not None and model_cannot_pay(res.costs, spec.k, [True] * res.batch):
            return build_adaptive(spec, params, res, None, draft.suffix)

        drafting = Drafting(res.draft_runner(), spec.k, params, res.target_vocab, res.row_params)
        drafter = ModelDrafter(drafting, res.target_device, guides=res.guides, audit=res.audit)
        drafter.reserve(res.batch, res.num_slots)
        return build_adaptive(spec, params, res, drafter, draft.suffix)
    from ssdlocal.draft.ssd.client import SSDDrafter

    return SSDDrafter(
        res.worker(),
        spec,
        params,
        res.target_vocab,
        res.num_slots,
        target_device=res.target_device_name,
        draft_device=draft.model.device,
        memory=res.memory,
        audit=res.audit,
    )


Builder = Callable[[SpecConfig, SamplingParams, DraftResources], object]

# Draft type -> the builder of its drafter. NoDraft has none: nothing proposes (AR only).
BUILDERS: dict[type, Builder] = {
    NgramDraft: build_ngram,
    SuffixDraft: build_suffix,
    ModelDraft: build_model,
    HeadDraft: build_head,
}


def make_drafter(spec: SpecConfig, params: SamplingParams, resources: DraftResources):
    """The drafter of a speculative call (`spec.mode` SD or SSD); None for AR. Its draft
    type's row in BUILDERS builds it; ValueError for a type with none (NoDraft, which
    config validation already refuses outside AR)."""
    if spec.mode is Mode.AR:
        return None
    builder = BUILDERS.get(type(spec.draft))
    if builder is None:
        raise ValueError(f"no drafter for {type(spec.draft).__name__}")
    return builder(spec, params, resources)
