"""What every backend offers the layers above: the Backend protocol (what a backend does
with files and models), the Runner protocol (one loaded model and its cache) and the slot
layout.

A runner owns one loaded model and its KV cache, and remembers for each row of a batch
`held[b]`: the tokens whose keys/values sit in that row's cache slots 0..len-1. It is the
one owner of how many tokens each row has cached (`cached`): while feeding, len(held[b]);
during steps, the count `begin_steps` started from, moved by the host counts `advance` is
given (callers keep no count of their own). The
engine, the drafters and the SSD speculator use only these methods; nobody edits a
runner's cache or bookkeeping from outside. A runner also keeps a bounded store of
earlier calls' prefixes (`setup_prefix`, `reuse`, `store`): a new call's row starts from
the longest stored prefix of its tokens and feeds only the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ssdlocal.core.choice import Choice
from ssdlocal.core.config import GraphMode
from ssdlocal.core.errors import UsageError
from ssdlocal.core.models import BackendName, ModelSpec
from ssdlocal.core.quantization import DType, Quantization


class Logits(Choice):
    """Which positions of a feed come back as logits (`Runner.feed`): every fed token's
    [len(row), V], the row's last token's [1, V], or none [0, V] (the cache is filled
    and nothing reaches the lm_head)."""

    ALL = "all"
    LAST = "last"
    NONE = "none"

    @classmethod
    def of(cls, value: Logits | str) -> Logits:
        """`value` as a member; ValueError (a caller's bug, not the user's) when it names none."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"logits must be one of {cls.choices()}, got {value!r}") from None


class Backend(Protocol):
    """What one backend does; each backend's package implements it (backends/torch/backend.py,
    backends/llamacpp/backend.py), importing its heavy libraries only inside the methods.
    Facts about the backend are its name's (core.models.BackendName: runs_gguf, quantizes,
    tensor_parallel); backends/registry.py is the one table of them."""

    name: BackendName

    def load(self, spec: ModelSpec, threads: int | None) -> Any:
        """The loaded model of `spec` (`threads`: CPU threads where the backend takes them,
        None: its default). Whatever it returns carries `backend` (this name)."""

    def make_runner(self, loaded: Any, tree: bool, graphs: GraphMode) -> Runner:
        """The Runner over `loaded`; `tree`: it will decode SSD fan-out trees; `graphs`:
        captured forwards where the backend captures."""

    def load_tokenizer(self, path: str) -> Any:
        """The model's tokenizer (transformers), reading no weights."""

    def preflight(self, path: str) -> None:
        """Cheap checks of the files (ModelLoadError / UsageError with a hint)."""

    def prepare(self, path: str | Path, quantization: Quantization, dtype: DType, progress: Any, floats: bool) -> Path:
        """The path `load` will read for `path`, built now (with progress) if not cached."""

    def build(self) -> Any:
        """What identifies the library the kernels come from beyond the machine's own key
        (core/measured.machine has torch's version), or None: timings kept for one build
        are not trusted for another."""

    def load_head(self, kind: str, path: str, shared: HeadInputs, target_vocab: int, device: Any) -> Any:
        """The runner of the draft head of `kind` (weights.formats.archs.HEADS) in directory
        `path`, on `device` beside a target that shares `shared` (Runner.head_inputs); a
        backend that runs no heads raises UsageError with a hint."""

    def context_length(self, path: str) -> int | None:
        """The model's context (positions) read without loading it, where the backend takes
        it as stored; None where it cannot say (torch may extend it by rope scaling)."""


@dataclass(frozen=True)
class LayerKV:
    """How one layer of a target keeps its keys and values, for a draft head that attends
    over them (HeadInputs.read_kv): its sliding window (None: full attention), kv heads and
    head width, and `source`, the layer whose cache it reads (itself unless it shares one)."""

    window: int | None
    kv_heads: int
    head_dim: int
    source: int


@dataclass(frozen=True)
class HeadInputs:
    """What a target model shares with a draft head that reads its hidden states: the token
    embedding module (the head embeds its drafts with it) and the factor the target scales
    embeddings by (None: none), the layers and the hidden width, and per layer how it keeps
    its keys and values (`kv`) with `read_kv(layer)`, for a head that attends over them (None:
    a target that shares no cache): layer `layer`'s keys and values as they are now, to read
    and never write, [B, Hkv, S, D] each (its source's cache); slot s of a row that feeds and
    steps in order holds position s. The cache may be reallocated by any later feed or step:
    call it again for every use. `lm_head`: the target's (a block drafter scores its drafts
    with it; None: not shared)."""

    embeddings: Any
    layers: int
    hidden_size: int
    dtype: torch.dtype
    embed_scale: float | None = None
    kv: tuple[LayerKV, ...] = ()
    read_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    lm_head: Any = None


HiddenLayers = tuple[int, ...]
"""Which hidden states of a model a drafter reads, in order: i (0 <= i < layers) is layer i's
output (the residual stream after it), FINAL_HIDDEN the last layer's output after the final
norm (what the lm_head reads). A runner gives them concatenated: [..., len(layers) * D]."""
FINAL_HIDDEN = -1


class Runner(Protocol):
    """One loaded model, its KV cache, and which tokens each row holds."""

    vocab_size: int
    num_slots: int  # cache slots per row after `reset`
    device: torch.device

    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows; (re)allocate the cache for this shape when needed."""

    def cached(self, row: int) -> int:
        """How many of row `row`'s tokens are in the cache (its first ones, in order). During
        steps: as moved by `advance`'s host counts; RuntimeError after an advance without them."""

    def pending(self, row: int, tokens: Sequence[int]) -> list[int]:
        """Tokens of `tokens` (the row's full sequence) not yet in the cache."""

    def holds(self, row: int, tokens: Sequence[int]) -> int:
        """How many of `tokens`' first tokens row `row`'s cache holds (in order)."""

    def feed(self, rows: Sequence[Sequence[int]], logits: Logits = Logits.ALL, progress=None) -> list[torch.Tensor]:
        """Append rows[b] to row b's cache; per row float32 logits on the runner's device:
        `logits` ALL [len(rows[b]), V], LAST [1, V] (its last token), NONE [0, V].
        Only the positions asked for are computed (a long prompt's logits are large).
        Long feeds go in chunks; `progress(done, total)` (tokens per row) is called as
        they finish, and an exception it raises stops the feed with `held` unchanged."""

    def setup_prefix(self, tokens: int) -> None:
        """Room for `tokens` stored prefix tokens (0: no store); drops what was stored."""

    def reuse(self, row: int, tokens: Sequence[int]) -> int:
        """Row `row`, empty after `reset`, takes the longest stored prefix of `tokens` (whole
        blocks); returns how many tokens it now holds."""

    def store(self, row: int, tokens: Sequence[int]) -> None:
        """Row `row`'s slots 0..len(tokens)-1 hold `tokens` (the caller knows): keep them
        for later calls' `reuse`. Stored only for this runner's own model."""

    def read_ahead(self, tokens: Sequence[int], n: int) -> int:
        """Read up to `n` more of `tokens` (a prompt not seated yet) into the prefix store,
        past the longest prefix it holds, without touching any row: between rounds, while
        steps go on. Returns how many of `tokens`' first tokens the store holds now (`n` 0:
        only that). A runner that cannot read ahead returns 0 (the prompt is read when its
        row is seated)."""

    def begin_steps(self) -> None:
        """Decode with `step` from here: each row's length is what it has cached."""

    def step(self, ids: torch.Tensor, bound: int | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] on the device at positions length..length+T-1 of each row ->
        logits [B, T, V] float32 (valid until the next step). Lengths do not move.
        `bound`, when known: max(length) + T over the rows (limits attention spans).
        `at` ([B] long on the device): only the logits at column at[b] of each row, [B, V];
        the ids past it are padding the step may skip (a catch-up needs the newest
        token's logits only, and a runner that computes only those saves the rest)."""

    def advance(self, n, host: Sequence[int] | None = None) -> None:
        """Each row's length += n (a [B] long tensor, possibly negative, or one int).
        `host`: the same per-row counts on the host, when the caller has them without a
        device read (the engine's rounds do); `cached` follows them."""

    def end_steps(self, kept: Mapping[int, Sequence[int]]) -> None:
        """Back to `feed` after steps that began at each row's cached tokens: row b in
        `kept` now also holds kept[b] (what its first steps wrote, in order); every other
        row holds what it held at `begin_steps`."""

    def sync(self, row: int, committed: Sequence[int]) -> None:
        """Keep only the cached tokens the next feed can build on (see `sync_held`)."""

    def warm_up(self, batch_size: int, widths: Sequence[int], at_widths: Sequence[int] = ()) -> int:
        """Ahead of use (a server's start): make room for `batch_size` rows and prepare the
        steps of `widths` tokens, and steps `at` one column of `at_widths` tokens, for every
        batch size up to it (captured graphs); returns how many were prepared (0 for a
        runner that captures nothing). Rows hold nothing afterwards."""

    def forward_raw(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tree step: ids/positions/slots [B, T], mask [B, T, S] -> logits [B, T, V] the
        caller owns; with `out` [B, W, V] (W <= T: the queries the caller keeps, the
        others are padding) the first W queries' logits are written there and `out` is
        returned (no tensor of the step's own). Writes the given slots but leaves each
        row's held tokens unchanged."""

    def tree_width(self, width: int) -> int:
        """How many queries a tree step of `width` branches should have (padding with
        queries that see only the trash slot; e.g. to reuse captured graphs)."""

    def tree_span(self, needed: int) -> int | None:
        """The slots a tree step should attend over when its layout needs `needed` (rows,
        scratch runs and trash placed right after the longest row: SlotLayout.placed), or
        None to keep the scratch runs after every row's whole budget (fixed slots)."""

    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """Adopt a tree branch: the k/v at scratch slots `src` become the row's slots
        start..start+len(src)-1, which now hold `tokens` (one per slot)."""

    def forget_prefixes(self) -> None:
        """Empty the prefix store (its size stays): later `reuse` finds nothing stored."""

    def keep_hidden(self, layers: HiddenLayers | None) -> None:
        """From now on every `feed` and `step` also keeps these hidden states (None: none),
        which `hidden()` returns. UsageError (with a hint) from a runner that cannot."""

    def head_inputs(self) -> HeadInputs:
        """What a draft head shares with this model (its token embeddings, layer count and
        width); UsageError (with a hint) from a runner that cannot share them."""

    def hidden(self) -> torch.Tensor:
        """The hidden states `keep_hidden` asked for, of the last feed or step, at every column
        it fed ([B, T, len(layers) * D]: row b's first len(rows[b]) columns of a feed are its
        tokens'); valid until the next feed or step."""

    def prefix_report(self) -> dict | None:
        """The prefix store's sizes and counts (backends.prefix.PrefixIndex.report, with
        bytes where the runner knows them), or None without a store."""

    def graph_report(self, since: dict | None = None) -> dict:
        """Captured-step counts as plain data ({"mode", "captured", "replays", "eager",
        "refused", "dropped"}, + "notes"), minus `since` (an earlier report of this runner);
        mode "off" for a runner that captures nothing."""


def kept_logits(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Runner.forward_raw's result: `logits` [B, T, V], or its first W queries copied into `out` [B, W, V]."""
    if out is None:
        return logits
    out.copy_(logits[:, : out.shape[1]])
    return out


def sync_held(held: list[int], committed: Sequence[int]) -> None:
    """Shorten `held` in place to what may stay cached before the next feed.

    That is the longest common prefix with `committed`, but never `committed`'s last
    token: its logits predict the next token, so the next feed must start with it. (It
    can already be cached when the bonus token equals the draft token rejected at that
    position, e.g. by verify's RESIDUAL_EPS fallback.)
    """
    n = max(0, min(len(held), len(committed) - 1))
    if held[:n] == list(committed[:n]):  # common case, C-speed comparison
        del held[n:]
        return
    keep = 0
    while held[keep] == committed[keep]:
        keep += 1
    del held[keep:]


class HeldRows:
    """The Runner methods over `held` (the token ids cached per row), shared by runners;
    `counts`: each row's cached tokens during steps (None while feeding), kept by the
    runner's begin_steps / advance / end_steps through `_count_*`."""

    held: list[list[int]]
    counts: list[int] | None = None

    def cached(self, row: int) -> int:
        """Runner.cached."""
        if self.counts is None:
            return len(self.held[row])
        if self.counts[row] < 0:
            raise RuntimeError(f"row {row}: advanced without host counts, its cached tokens are not known here")
        return self.counts[row]

    def _count_begin(self) -> None:
        self.counts = [len(h) for h in self.held]

    def _count_advance(self, n, host: Sequence[int] | None) -> None:
        if self.counts is None:
            return
        if host is None and not isinstance(n, int):
            self.counts = [-1] * len(self.counts)  # unknown on the host until the next begin_steps
            return
        steps = host if host is not None else [n] * len(self.counts)
        self.counts = [c + int(s) if c >= 0 else c for c, s in zip(self.counts, steps)]

    def _count_end(self) -> None:
        self.counts = None

    def pending(self, row: int, tokens: Sequence[int]) -> list[int]:
        """Tokens of `tokens` (the row's full sequence) not yet in the cache."""
        return list(tokens[len(self.held[row]) :])

    def holds(self, row: int, tokens: Sequence[int]) -> int:
        """How many of `tokens`' first tokens row `row`'s cache holds (in order)."""
        held = self.held[row]
        n = min(len(held), len(tokens))
        if held[:n] == list(tokens[:n]):
            return n
        return next(i for i in range(n) if held[i] != tokens[i])

    def sync(self, row: int, committed: Sequence[int]) -> None:
        """Keep only the cached tokens the next feed can build on (see `sync_held`)."""
        sync_held(self.held[row], committed)

    def tree_span(self, needed: int) -> int | None:
        """Runner.tree_span: by default the fixed layout (None)."""
        return None

    def read_ahead(self, tokens: Sequence[int], n: int) -> int:
        """Runner.read_ahead: by default nothing is read ahead (0)."""
        return 0

    def keep_hidden(self, layers: HiddenLayers | None) -> None:
        """Runner.keep_hidden: by default a runner keeps none (UsageError when asked)."""
        if layers:
            raise UsageError(
                f"the {type(self).__name__} cannot give a drafter the target's hidden states",
                "run the target on the torch backend (--target-backend torch), or use a draft model",
            )

    def head_inputs(self) -> HeadInputs:
        """Runner.head_inputs: by default a runner shares nothing (UsageError)."""
        raise UsageError(
            f"the {type(self).__name__} cannot share its embeddings with a draft head",
            "run the target on the torch backend (--target-backend torch), or use a draft model",
        )

    def hidden(self) -> torch.Tensor:
        """Runner.hidden: none kept (keep_hidden refuses them)."""
        raise RuntimeError(f"the {type(self).__name__} keeps no hidden states")


@dataclass(frozen=True)
class SlotLayout:
    """The cache slots of one row, defined once for the engine and the SSD draft.

    [0, main): the row's own tokens: prompt, generated tokens, and one round of drafts
    past the budget; then `branches` scratch runs of `depth` slots (SSD pre-speculation,
    branch i starts at main + i * depth); the last slot is a trash slot that padded tree
    queries write to.
    """

    main: int
    branches: int = 0
    depth: int = 0

    @classmethod
    def for_generation(cls, longest_row: int, k: int) -> SlotLayout:
        """The target's rows: the longest prompt + budget, then K drafts of the last round
        (scored, never committed, so they may pass the model's context) + 2 spare."""
        return cls(longest_row + k + 2)

    def with_tree(self, branches: int, k: int) -> SlotLayout:
        """The SSD draft's rows: the target's tokens plus the proposal not yet verified
        (K + 2 more main slots), then `branches` scratch runs of K slots and the trash."""
        return SlotLayout(self.main + k + 2, branches, k)

    @property
    def total(self) -> int:
        return self.main + self.branches * self.depth + (1 if self.branches else 0)

    @property
    def trash(self) -> int:
        return self.total - 1

    def scratch(self, branch: int, step: int = 0) -> int:
        return self.main + branch * self.depth + step

    def placed(self, total: int) -> SlotLayout:
        """The same scratch runs and trash moved to end at slot `total` (>= this layout's
        needs): a tree step then attends over `total` slots, not the rows' whole budget."""
        return SlotLayout(total - self.branches * self.depth - (1 if self.branches else 0), self.branches, self.depth)
