"""Drafts for tests from the text a user would type (None, "ngram" or a checkpoint path)."""

from __future__ import annotations

from dataclasses import replace

from ssdlocal.cli.resolve import parse_draft
from ssdlocal.core.config import Draft, ModelSpec


def draft_of(text: str | None, device: str = "cpu", dtype: str = "float32", suffix: bool = True, **model) -> Draft:
    """NoDraft / NgramDraft / SuffixDraft / ModelDraft(ModelSpec(text, device, dtype, **model));
    fp32 by default, as the token-for-token tests need; `suffix`: a model draft's rounds
    may use suffix proposals (False: the model's drafts only)."""
    draft = parse_draft(text, lambda path: ModelSpec(path, device, dtype, **model))
    return draft if suffix or draft.kind != "model" else replace(draft, suffix=None)


def row_views(*sequences):
    """Rows as drafters read them (`tokens`, `length`), from token lists."""
    from types import SimpleNamespace

    return [SimpleNamespace(tokens=list(s), length=len(s), tail=lambda start, s=list(s): s[start:]) for s in sequences]
