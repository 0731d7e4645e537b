"""How many positions a call may fill, and which model sets that limit.

The target's context bounds every call; a call that runs the draft model is also bounded by
the draft's (its model here, the SSD worker's, or, while it waits unloaded, what its file
states), less what SSD's draft holds beyond the target: the unverified proposal (K + 2).
Prompts that leave no room are refused here with a hint, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ssdlocal.core.config import Mode, SpecConfig
from ssdlocal.core.errors import UsageError


class ContextLimits:
    """`target_context`: the target's positions; `draft_context()`: the draft model's (None
    while unknown); `resolved(spec)`: a call's settings as it runs them (auto resolved)."""

    def __init__(
        self,
        target_context: int,
        draft_context: Callable[[], int | None],
        resolved: Callable[[SpecConfig], SpecConfig],
    ) -> None:
        self.target_context = target_context
        self.draft_context = draft_context
        self.resolved = resolved

    def limit(self, spec: SpecConfig) -> tuple[int, str]:
        """(positions one call with `spec` may fill, the model that sets the limit)."""
        spec = self.resolved(spec)
        limit, which = self.target_context, "the target model"
        draft_context = self.draft_context()
        if spec.mode is not Mode.AR and spec.draft.model is not None and draft_context is not None:
            extra = spec.k + 2 if spec.mode is Mode.SSD else 0
            if draft_context - extra < limit:
                limit, which = draft_context - extra, "the draft model"
        return limit, which

    def budgets(self, prompt_lengths: Sequence[int], max_new_tokens: int | None, spec: SpecConfig) -> list[int]:
        """New tokens each prompt may get: `max_new_tokens`, or (None) the rest of the
        context. UsageError when a prompt leaves no room for them."""
        limit, which = self.limit(spec)
        for n in prompt_lengths:
            if max_new_tokens is None and n >= limit:
                raise UsageError(f"the prompt has {n} tokens, {which}'s context is {limit}", "shorten the prompt")
            if max_new_tokens is not None and n + max_new_tokens > limit:
                raise UsageError(
                    f"prompt ({n} tokens) + max-new-tokens ({max_new_tokens}) needs "
                    f"{n + max_new_tokens} positions, {which}'s context is {limit}",
                    "shorten the prompt or lower --max-new-tokens",
                )
        return [limit - n if max_new_tokens is None else max_new_tokens for n in prompt_lengths]
