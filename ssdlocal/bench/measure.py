"""One timed generation call of one system (our mode or a peer) over one batch of prompts.

`Measurement` is the common record every system returns; `from_engine_events` builds it
from an Engine event stream with core.stats (the same counts as the engine's own stats).
Timing contract (docs/architecture.md §3): `ttft_s` is the time to the first generated
token, `decode_s` the time from there to the end, and `decode_tokens` the generated tokens
after each row's first one, so tokens_per_s = decode_tokens / decode_s excludes prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ssdlocal.core.events import Event
from ssdlocal.core.metrics import Metrics
from ssdlocal.core.stats import RunStats, consume_all


@dataclass
class Measurement:
    system: str  # "ar" | "sd" | "ssd" | "hf" | "hf-assisted" | "llamacpp" | ...
    token_ids: list[list[int]]  # per row, generated tokens only
    finish: list[str]
    ttft_s: float | None
    decode_s: float
    decode_tokens: int
    spec: dict[str, Any] | None = None  # speculation counters (our SD/SSD modes)
    snapshot: Metrics | None = None  # the engine's own metrics of the call, as reported
    prompt_tokens: int | None = None  # the batch's prompt tokens, when the system says
    cached_tokens: int | None = None  # of which came from a prefix kept by earlier calls
    prefill_s: float | None = None  # the time the prompts took to read (else ttft_s is the bound)

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "token_ids": self.token_ids,
            "finish": self.finish,
            "tokens": sum(len(t) for t in self.token_ids),
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "decode_tokens": self.decode_tokens,
            "tokens_per_s": self.tokens_per_s,
            "spec": self.spec,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
        }

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens read (not reused) per second of reading them."""
        seconds = self.prefill_s if self.prefill_s is not None else self.ttft_s
        if not self.prompt_tokens or not seconds:
            return None
        read = self.prompt_tokens - (self.cached_tokens or 0)
        return read / seconds if read > 0 else None


def from_engine_events(system: str, events: Iterable[Event], k: int) -> Measurement:
    """Consume an Engine.generate stream: the call's raw counts (core.stats) become the
    record's `spec`, from which aggregate.py computes every rate."""
    stats = RunStats(k=k)
    done = consume_all(stats, events)
    if done is None:
        raise RuntimeError("engine stream ended without a DoneEvent")  # engine contract broken
    counts = stats.counts
    return Measurement(
        system=system,
        token_ids=[list(o.token_ids) for o in done.outputs],
        finish=[o.finish_reason for o in done.outputs],
        ttft_s=done.stats.ttft_s,
        decode_s=counts.decode_s,
        decode_tokens=counts.decode_tokens,
        spec=counts.as_dict() if k > 0 or counts.rounds else None,
        snapshot=done.stats,
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_prompt_tokens,
        prefill_s=counts.prefill_s,
    )
