"""Engine.serve driven as the server drives it, for the batching tests: `serve` runs
requests that start together, join once another has some tokens, or are cancelled, and
collects each one's tokens, finish reason and log-probabilities (`Served`)."""

from __future__ import annotations

from collections import defaultdict

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import PrefillEvent, SeatedEvent, TokensEvent
from ssdlocal.engine.request import Inbox


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


class Served:
    """Per request: tokens, finish reason, log-probabilities; the seatings in order."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.finish: dict[int, str] = {}
        self.logprobs: dict[int, list] = defaultdict(list)
        self.seatings: list[SeatedEvent] = []
        self.prefills: list[PrefillEvent] = []
        self.first_at: dict[int, float] = {}
        self.order: list[int] = []  # requests in the order they finished


def serve(engine, spec, start, joins=(), cancels=(), max_batch: int = 8) -> Served:
    """Run Engine.serve: `start` requests at once; each (request, after, n) of `joins` joins
    once request `after` has n tokens; each (request, n) of `cancels` is cancelled once it
    has n tokens. Ends when every request has finished."""
    inbox, out = Inbox(), Served()
    inbox.add(*start)
    joins, cancels = list(joins), list(cancels)
    everyone = {r.id for r in start} | {r.id for r, *_ in joins}
    seated: list[int] = []
    for event in engine.serve(inbox, max_batch=max_batch, spec=spec):
        if isinstance(event, SeatedEvent):
            seated = list(event.requests)
            out.seatings.append(event)
        elif isinstance(event, PrefillEvent):
            out.prefills.append(event)
        elif isinstance(event, TokensEvent):
            rid = seated[event.row]
            assert rid not in out.finish, "tokens after the row finished"
            out.first_at.setdefault(rid, event.at)
            out.tokens[rid] += event.token_ids
            out.logprobs[rid] += event.logprobs or ()
            if event.finish_reason is not None:
                out.finish[rid] = event.finish_reason
                out.order.append(rid)
        for item in [j for j in joins if len(out.tokens[j[1].id]) >= j[2]]:
            joins.remove(item)
            inbox.add(item[0])
        for item in [c for c in cancels if len(out.tokens[c[0].id]) >= c[1]]:
            cancels.remove(item)
            inbox.cancel(item[0].id)
            out.finish[item[0].id] = "cancelled"
        if not joins and everyone <= set(out.finish):
            inbox.close()
    return out
