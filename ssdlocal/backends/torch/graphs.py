"""Captured forwards: one graph per input shape, replayed with static buffers, never trusted blindly.

A decode step of a small model is bound by kernel launches, not memory: capturing the
whole forward once per shape and replaying it removes that cost (the nano-vllm pattern:
static input and output buffers, one memory pool). A replay reads every tensor at the
address it had at capture, so `GraphCache` guards three ways against a graph that would
change the output:
- the audit: at capture, every tensor the (traced) step reads besides its inputs must be
  registered static by its owner (parameters, buffers, KV cache, RoPE tables, declared
  state); an unregistered one refuses that shape (it runs eagerly) with a warning, or
  fails loudly under SSDLOCAL_GRAPHS_STRICT=1 (the test suite sets it);
- the guard: before each replay the owner's rebindable static tensors must still be the
  ones captured; if one was rebound, every graph is dropped and recaptured;
- the self-check: the first replay of each shape is compared with an eager run of the
  same inputs; on a difference the cache drops its graphs and runs eagerly from then on.
Refusals and drops are counted in `GraphStats` and never only logged at DEBUG.
Modes (core.config.GraphMode): AUTO (CUDA graphs on CUDA devices, none elsewhere), OFF,
TRACE (the CPU twin of CUDA graphs, capture.TracedGraphs); SSDLOCAL_GRAPHS overrides the
configured mode, parsed where it is read (resolve_mode).
A cache can be mirrored (`run(..., mirror=)`): every primitive it runs (an eager call, a
capture, a replay) is announced first, so the other ranks of a tensor-parallel group run
the same primitive on the same inputs and their collectives meet (parallel/group.py); after
a capture "captured" is announced, where a mirror raises CaptureError if one of its ranks
could not capture, and the shape is refused for all of them (eager everywhere).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor

from ssdlocal.backends.torch.capture import CaptureError, Captured, CudaGraphs, TracedGraphs, storage_key
from ssdlocal.core.config import GraphMode

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch rows, tree widths and catch-up widths are padded up to one of these
MAX_GRAPHS = 64  # graphs kept per cache; the least recently used goes first past it
ENV_MODE = "SSDLOCAL_GRAPHS"  # overrides the configured mode in every command (and the server)
ENV_STRICT = "SSDLOCAL_GRAPHS_STRICT"  # "1": audit failures and rebinds raise (tests)
MAX_NOTES = 8  # reasons kept per cache for refusals and drops


class GraphSafetyError(RuntimeError):
    """A captured step would read memory its owner does not keep in place (strict mode)."""


def bucket(width: int) -> int:
    """The smallest bucket >= width (widths past the last bucket are their own bucket)."""
    return next((b for b in BUCKETS if b >= width), width)


class StaticTensors(Protocol):
    """What a graph's owner declares about the tensors its steps read besides their inputs."""

    def registered(self) -> Iterable[Tensor]:
        """Every tensor a captured step may read: kept alive and updated only in place."""

    def state_tensors(self) -> tuple[Tensor, ...]:
        """The registered tensors the owner may legitimately reallocate (KV cache, RoPE
        tables, per-row lengths); compared by identity before every replay."""

    def describe(self, tensor: Tensor) -> str:
        """A readable name for a tensor a step read (for audit messages)."""


@dataclass
class GraphStats:
    """Counts of one cache's life; `minus` gives one call's share."""

    captured: int = 0  # shapes captured
    replays: int = 0  # steps served by a replay
    eager: int = 0  # steps run eagerly (refused shapes, or graphs dropped)
    refused: int = 0  # shapes refused (memory budget, capture failure, audit)
    dropped: int = 0  # times every graph was dropped (rebound state, self-check mismatch)
    evicted: int = 0  # graphs let go, least recently used first, to capture a new shape past max_graphs

    def minus(self, before: GraphStats) -> GraphStats:
        return GraphStats(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    def copy(self) -> GraphStats:
        return GraphStats(*(getattr(self, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GraphCache:
    """Captured step functions keyed by shape, within a memory budget.

    `reserve_bytes`: capture is refused when the device would have less free memory than
    this afterwards (what the KV cache and activations of eager work still need).
    `max_graphs`: graphs kept; capturing one more lets the least recently replayed go,
    never refuses the shape. `on_forget(key)` is told of every key let go that way or
    refused after a capture was tried, so a mirror's ranks let their graph of it go too.
    `statics`: the owner's declaration (StaticTensors); without one nothing is audited or
    guarded (unit tests of the bookkeeping only).
    """

    def __init__(
        self,
        backend,
        statics: StaticTensors | None = None,
        *,
        reserve_bytes: int = 1 << 30,
        max_graphs: int = MAX_GRAPHS,
        strict: bool | None = None,
        self_check: bool = True,
    ) -> None:
        self.backend = backend
        self.statics = statics
        self.reserve_bytes = reserve_bytes
        self.max_graphs = max_graphs
        self.on_forget: Callable[[Hashable], None] | None = None
        self.strict = os.environ.get(ENV_STRICT) == "1" if strict is None else strict
        self.self_check = self_check
        self.disabled = False  # a self-check failed: eager from now on
        self.notes: list[str] = []  # why shapes were refused or graphs dropped (bounded)
        self.stats = GraphStats()
        self._graphs: OrderedDict[Hashable, Captured] = OrderedDict()  # least recently used first
        self._refused: set[Hashable] = set()
        self._checked: set[Hashable] = set()
        self._state: tuple[Tensor, ...] | None = None  # the owner's state at the first capture
        self._mirror: Callable[[str, Hashable], None] | None = None  # set during `run`

    @property
    def kind(self) -> str:
        return getattr(self.backend, "kind", "emulated")

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self,
        key: Hashable,
        fn: Callable[..., Tensor],
        *,
        mirror: Callable[[str, Hashable], None] | None = None,
        **inputs: Tensor,
    ) -> Tensor:
        """fn(**inputs), replayed from a capture when one exists or can be made.

        The returned tensor is a static buffer (the graph-pool rule, capture.py): read or
        clone it before the next call into this cache, whatever its key.
        `mirror(action, key)`, when given, is called before each primitive this call runs,
        in order: "eager" (fn runs as is), "capture" (the backend captures fn), then
        "captured" (the mirror may raise CaptureError: a rank could not), "replay".
        """
        self._mirror = mirror
        try:
            return self._run(key, fn, inputs)
        finally:
            self._mirror = None

    def _run(self, key, fn, inputs) -> Tensor:
        if self.disabled:
            return self._eager(fn, inputs, key)
        self._guard_state()
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
        if captured is None and key not in self._refused:
            captured = self._capture(key, fn, inputs)
            if captured is not None and captured.computed:
                return captured.output  # the capture ran this very step (same inputs)
        if captured is None:
            return self._eager(fn, inputs, key)
        self._announce("replay", key)
        out = captured.replay(inputs)
        self.stats.replays += 1
        if self.self_check and key not in self._checked:
            return self._first_replay_check(key, fn, inputs, out)
        return out

    def _announce(self, action: str, key) -> None:
        if self._mirror is not None:
            self._mirror(action, key)

    def _eager(self, fn, inputs, key=None) -> Tensor:
        self.stats.eager += 1
        self._announce("eager", key)
        return fn(**inputs)

    # ------------------------------------------------------------------ capture
    def _capture(self, key, fn, inputs) -> Captured | None:
        free = self.backend.free_bytes()
        if free is not None and free < self.reserve_bytes:
            return self._refuse(key, "memory budget")
        while len(self._graphs) >= self.max_graphs:
            self._evict()
        try:
            self._announce("capture", key)
            try:
                captured = self.backend.capture(fn, inputs)
            finally:
                self._announce("captured", key)  # a mirror's ranks say whether theirs worked (CaptureError if not)
        except (RuntimeError, CaptureError) as exc:  # an op that cannot be captured (here or on a rank): eager
            if self.on_forget is not None:
                self.on_forget(key)  # ranks that did capture it let it go
            return self._refuse(key, f"capture failed ({str(exc).splitlines()[0][:100]})")
        unregistered = self._audit(captured)
        if unregistered:
            what = ", ".join(unregistered)
            if self.strict:
                raise GraphSafetyError(f"captured step {key} reads tensors not registered static: {what}")
            return self._refuse(key, f"reads tensors not registered static: {what}")
        if self._state is None and self.statics is not None:
            self._state = tuple(self.statics.state_tensors())
        self._graphs[key] = captured
        self.stats.captured += 1
        return captured

    def _evict(self) -> None:
        """Let the least recently used graph go (its memory returns to the pool)."""
        key, _ = self._graphs.popitem(last=False)
        self._checked.discard(key)
        self.stats.evicted += 1
        if self.on_forget is not None:
            self.on_forget(key)

    def _audit(self, captured: Captured) -> list[str]:
        """Names of tensors the step reads that its owner did not register as static."""
        if self.statics is None or not captured.reads:
            return []
        known = {storage_key(t) for t in self.statics.registered()}
        return [self.statics.describe(t) for t in captured.reads if storage_key(t) not in known]

    def _refuse(self, key, why: str) -> None:
        self._refused.add(key)
        self.stats.refused += 1
        self._note(f"shape {key}: {why}")
        return None

    # ------------------------------------------------------------------ guards
    def _guard_state(self) -> None:
        """Drop every graph if the owner rebound a tensor the graphs read (a bug: the
        owner calls `clear` when it reallocates on purpose)."""
        if self._state is None or self.statics is None:
            return
        now = tuple(self.statics.state_tensors())
        if len(now) == len(self._state) and all(a is b for a, b in zip(now, self._state)):
            return
        changed = [self.statics.describe(b) for a, b in zip(self._state, now) if a is not b]
        msg = f"a static tensor was rebound after capture ({', '.join(changed) or 'count changed'})"
        if self.strict:
            raise GraphSafetyError(msg)
        self.drop(msg + ": graphs recaptured")

    def _first_replay_check(self, key, fn, inputs, out: Tensor) -> Tensor:
        """Compare the first replay of `key` with an eager run of the same inputs."""
        self._checked.add(key)
        replayed = out.clone()
        self._announce("eager", key)
        want = fn(**inputs)  # writes the same cache slots with the same values
        if _same(replayed, want):
            return out
        self.drop(f"shape {key}: the replay differs from eager")
        self.disabled = True
        log.warning("captured step %s gave other logits than eager: graphs dropped, eager from now on", key)
        return want

    def drop(self, why: str) -> None:
        """Forget every capture because of a fault (counted, and noted for the user)."""
        self.stats.dropped += 1
        self._note(why)
        log.warning("graphs dropped: %s", why)
        self.clear()

    def _note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text)

    def clear(self) -> None:
        """Forget every capture (the buffers they read, e.g. the KV cache, are gone)."""
        self._graphs.clear()
        self._refused.clear()
        self._checked.clear()
        self._state = None


def _same(a: Tensor, b: Tensor) -> bool:
    """Replayed and eager logits agree: the same argmax everywhere and close values (a
    graph replays the eager kernels, but a library may pick another algorithm inside a
    capture; a stale read differs grossly)."""
    if a.shape != b.shape:
        return False
    if not torch.equal(a.argmax(-1), b.argmax(-1)):
        return False
    return bool(torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3))


def graph_report(runner, since: dict | None = None) -> dict:
    """A runner's graph counts as plain data: {"mode", "captured", "replays", "eager",
    "refused", "dropped", "evicted"} (+ "notes" when shapes were refused or graphs dropped), minus
    `since` (an earlier report of the same runner). Runners without graphs: mode "off"."""
    cache = getattr(runner, "graphs", None)
    if cache is None:
        return {"mode": "off", **GraphStats().as_dict()}
    counts = cache.stats.as_dict()
    if since:
        counts = {name: value - since.get(name, 0) for name, value in counts.items()}
    report = {"mode": cache.kind, **counts}
    if cache.notes and (counts["refused"] or counts["dropped"]):
        report["notes"] = list(cache.notes)
    return report


def resolve_mode(configured: GraphMode) -> GraphMode:
    """The graph mode to use: SSDLOCAL_GRAPHS when set to off or trace, else `configured`.
    Both are parsed here (an unknown word: UsageError listing the modes)."""
    env = os.environ.get(ENV_MODE, "").strip()
    override = GraphMode.parse(env, ENV_MODE) if env else GraphMode.AUTO
    return override if override is not GraphMode.AUTO else GraphMode.parse(configured, "graphs setting")


def capture_backend(device: torch.device, mode: GraphMode) -> CudaGraphs | TracedGraphs | None:
    """What captures steps on `device` in graph mode `mode` (see resolve_mode): None for none."""
    mode = resolve_mode(mode)
    if mode is GraphMode.OFF or (mode is GraphMode.AUTO and device.type != "cuda"):
        return None
    return TracedGraphs() if mode is GraphMode.TRACE else CudaGraphs(device)


def make_graph_cache(device: torch.device, mode: GraphMode, statics: StaticTensors | None = None) -> GraphCache | None:
    """The graph cache for a model on `device` in graph mode `mode` (see resolve_mode)."""
    backend = capture_backend(device, mode)
    return None if backend is None else GraphCache(backend, statics)
