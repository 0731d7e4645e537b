"""TorchRunner: the Runner protocol (backends/base.py) over our torch models (backends/torch/models).

Two ways to feed a row's tokens. `feed` takes host token lists of any length (prefill, the
SSD speculator) and remembers `held[b]`, the tokens in slots 0..len-1. `step` is the decode
path: ids already on the device, positions from the per-row `lengths` kept on the device
and moved only by `advance` (in place), causal masks built on the device, and, on CUDA, one
captured graph per (batch bucket, tokens, span bucket) shape (shapes.py: rows and catch-up
widths padded to graphs.BUCKETS, spans to eighths of a doubling).

Graphs live as long as the runner: the KV cache is sized in rows for the largest batch seen
(a bucket; `warm_up` sizes it for a server's largest batch and captures its common steps
before the first request), and a smaller batch uses its first rows, so a re-seat keeps
every cache tensor and graph. Every tensor a captured step reads besides its inputs is
static: the model's parameters and buffers (KV cache, RoPE tables) and this runner's
`DecodeState`, changed only in place. The runner registers them with its graph cache
(`registered`, `state_tensors`) and clears the cache itself when it reallocates one (more
rows, or the slots doubling). Rejected drafts need no rollback: the write position is the
only cache state (as in gpt-fast). Knows nothing about speculation.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ssdlocal.backends.base import FINAL_HIDDEN, HeadInputs, HeldRows, HiddenLayers, Logits, kept_logits
from ssdlocal.backends.torch.ahead import StagingRow
from ssdlocal.backends.torch.stored import StoredPrefixes
from ssdlocal.backends.prefix import PrefixIndex
from ssdlocal.backends.torch.heads.shared import shared_with_heads
from ssdlocal.backends.torch.graphs import bucket, graph_report, make_graph_cache
from ssdlocal.core.config import GraphMode
from ssdlocal.backends.torch.decode_state import DecodeState, bucket_span
from ssdlocal.backends.torch.kvcache import rounded_slots
from ssdlocal.backends.torch.loader import LoadedModel
from ssdlocal.backends.torch.models import CausalLM, causal_mask
from ssdlocal.backends.torch.prefill_path import dense_dtype
from ssdlocal.backends.torch.shapes import padded, padded_tree_mask, warm_steps
from ssdlocal.core.errors import UsageError
from ssdlocal.core.hostsync import Site, detached_site

FIRST_CAPACITY = 1024  # slots per row allocated at first; doubled as rows grow
STEP_OFFSETS = 64  # widest `step` served by the static offsets (wider ones grow them)
PREFILL_CHUNK = 512  # a long feed reads this many tokens per row at a time, layer by layer
# Feeds of at least this many rows may expand quantized weights to dense ones once per layer,
# when this machine's timings say it pays (backends/torch/prefill_path.py).
DENSE_MIN_TOKENS = 128


class TorchRunner(StoredPrefixes, HeldRows):
    """One model, its static KV cache, and which tokens (or how many) each row holds."""

    def __init__(self, loaded: LoadedModel, *, graphs: GraphMode = GraphMode.AUTO) -> None:
        self.loaded = loaded
        self.site = detached_site("runner")  # host -> device inputs: staged (count_host_waits)
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.args.vocab_size
        self.held: list[list[int]] = []
        self.num_slots = 0  # slots per row a call may use at most
        self.capacity = 0  # slots per row allocated now (grows up to num_slots)
        self.state = DecodeState(0, STEP_OFFSETS, self.device)
        self.plain = isinstance(self.model, CausalLM)  # not a tensor-parallel group
        # A tensor-parallel model captures on every rank itself (parallel/group.py); its
        # rank 0 cache is this runner's `graphs` all the same (counts, clear, span buckets).
        # What the runner owns refers back to it weakly: no reference cycle, so a runner let go
        # frees its graphs' memory pool and its staging cache at once, not at the next collection.
        me = weakref.proxy(self)
        self.graphs = make_graph_cache(self.device, graphs, me) if self.plain else self.model.use_graphs(graphs)
        self.prefix: PrefixIndex | None = None  # earlier calls' prefixes (setup_prefix)
        self.prefix_token_bytes = 0
        self.staging = StagingRow(me)  # a one-row cache for reading prompts ahead (read_ahead)
        self.hidden_layers: HiddenLayers | None = None  # what keep_hidden asked for
        self._hidden: Tensor | None = None  # the last feed's or step's hidden states

    @property
    def lengths(self) -> Tensor:
        """[B] long on the device: each row's length for `step` (`advance`), the cache's first B rows."""
        return self.state.lengths[: len(self.held)]

    @property
    def rows(self) -> int:
        """Rows the KV cache holds (a batch of B <= rows uses the first B)."""
        return self.state.lengths.numel() if self.capacity else 0

    # ------------------------------------------------------------------ static tensors
    def registered(self) -> Iterator[Tensor]:
        """Every tensor a captured step may read besides its inputs (graphs.StaticTensors)."""
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from self.state.tensors()

    def state_tensors(self) -> tuple[Tensor, ...]:
        """The registered tensors this runner may reallocate, compared before each replay."""
        caches = (t for cache in self.model.caches() for t in cache.tensors())
        return (*self.state.tensors(), *self.model.rope_tables(), *caches)

    def describe(self, tensor: Tensor) -> str:
        """Where a tensor read by a step lives: an attribute of this runner or its model."""
        for owner, prefix in ((self, "runner"), (self.state, "runner.state"), (self.model, "model")):
            names = owner.__slots__ if hasattr(owner, "__slots__") else vars(owner)
            for name in names:
                value = getattr(owner, name, None)
                if (
                    isinstance(value, Tensor)
                    and value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                ):
                    return f"{prefix}.{name}"
        return f"a {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor made at capture"

    # ------------------------------------------------------------------ rows
    def count_host_waits(self, site: Site) -> None:
        """Count this runner's host -> device inputs in `site` (core.hostsync) from now on. A
        tensor-parallel group bounds the model's reads: a rank that hangs inside a step
        (a captured all-reduce waits for it on the device) fails the read instead of
        blocking it for ever."""
        self.site = site
        if not self.plain:
            site.audit.bound(site.model, self.model.group.collective_timeout_s, self.model.group.stalled)

    def reset(self, batch_size: int, num_slots: int) -> None:
        """Forget all rows. The KV cache (and with it every captured graph) is kept while it
        has rows enough; a larger batch allocates one of the next bucket's rows (graphs.
        BUCKETS), small (a tensor-parallel model allocates `num_slots` at once: its ranks
        cannot grow)."""
        full = not self.plain and num_slots > self.capacity
        if batch_size > self.rows or full:
            first = min(num_slots, FIRST_CAPACITY) if self.plain else num_slots
            self._allocate(max(bucket(batch_size), self.rows), rounded_slots(first))
        self.num_slots = num_slots
        self.held = [[] for _ in range(batch_size)]
        self.state.lengths.zero_()
        self.staging.drop()
        self._count_end()

    def _allocate(self, rows: int, capacity: int) -> None:
        self.model.setup_cache(rows, capacity, self.loaded.dtype, self.device)
        self.capacity = capacity
        if rows != self.state.lengths.numel():
            self._new_state(rows, self.state.offsets.numel())
        self._graphs_invalid()  # they read the old cache

    def _ensure(self, slots: int) -> None:
        """Room for slot indices below `slots`: double the capacity (up to num_slots,
        rounded) keeping the contents; needing more than num_slots is a caller bug."""
        if slots <= self.capacity:
            return
        limit = rounded_slots(self.num_slots)
        if slots > limit or not self.plain:
            raise RuntimeError(f"KV cache too small: slot {slots - 1}, {self.num_slots} sized")
        self._grow(min(limit, rounded_slots(max(slots, 2 * self.capacity))))

    def _room_for_pads(self, slots: int) -> None:
        """Room for a padded feed's slot indices below `slots`. Every row of a feed takes
        the longest row's width, so a row that holds many tokens and feeds few (a carried
        row after a prefix-cache hit) beside one that feeds many (a new prompt) pads past
        num_slots, though each row's own tokens fit. The pads' keys/values are never read;
        a plain runner grows its cache for them, a tensor-parallel group (allocated once)
        cannot."""
        if slots <= self.capacity:
            return
        if not self.plain:
            raise RuntimeError(f"KV cache too small for a padded feed: slot {slots - 1}, {self.num_slots} sized")
        self._grow(rounded_slots(slots))

    def _grow(self, slots: int) -> None:
        """Enlarge the cache to `slots`, keeping what it holds."""
        self.model.grow_cache(slots)
        self.capacity = self.model.num_slots
        self._graphs_invalid()  # they read the old cache

    def _graphs_invalid(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    # ------------------------------------------------------------------ host feeds
    @torch.inference_mode()
    def feed(self, rows: Sequence[Sequence[int]], logits: Logits = Logits.ALL, progress=None) -> list[Tensor]:
        """Append rows[b] to row b's cache; per row float32 logits on the runner's device:
        `logits` ALL [len(rows[b]), V], LAST [1, V] (the row's last token), NONE [0, V]
        (ValueError for anything else). Empty rows give [0, V]. Only the positions asked
        for reach the lm_head.

        Long feeds (a prompt) are read in chunks of PREFILL_CHUNK tokens, layer by layer,
        with quantized weights expanded to dense ones once per layer where that measures
        faster (backends.torch.prefill_path); `progress(done,
        total)` (tokens) is called as chunks finish, and if it raises the feed stops
        there with no row's held tokens changed."""
        logits = Logits.of(logits)
        lengths = [len(r) for r in rows]
        t_max = max(lengths)
        if t_max == 0:
            return [torch.empty(0, self.vocab_size, device=self.device) for _ in rows]
        starts = [len(h) for h in self.held]
        self._ensure(max(s + n for s, n in zip(starts, lengths)))  # the rows' own tokens
        self._room_for_pads(max(starts) + t_max)  # [B, t_max] writes: shorter rows pad past theirs
        staged = self.site.upload([[s] + list(r) + [0] * (t_max - len(r)) for s, r in zip(starts, rows)], self.device)
        ids = staged[:, 1:].contiguous()  # [B, T]; pads write past held, harmless
        positions = staged[:, :1] + torch.arange(t_max, device=self.device)  # [B, T]
        fresh = not any(starts) and len(set(lengths)) == 1
        keep = self._kept_positions(lengths, logits)  # [B, n] or None (all)
        rows_in = len(rows) * t_max  # rows every linear multiplies
        if self.plain and (t_max > PREFILL_CHUNK or rows_in >= DENSE_MIN_TOKENS):
            layers = len(self.model.layers)
            report = None if progress is None else (lambda done, total: progress(done // layers, total // layers))
            dense = dense_dtype(self.model, rows_in) if rows_in >= DENSE_MIN_TOKENS else None
            out = self.model.prefill(
                ids,
                positions,
                keep,
                PREFILL_CHUNK,
                fresh=fresh,
                dense=dense,
                progress=report,
                starts=starts,
                hidden=self.hidden_layers,
                hidden_all=True,
            )
        elif not self.plain and t_max > PREFILL_CHUNK:
            out = self._chunked_forward(ids, positions, keep, progress, max(starts))
        else:
            mask = None if self.plain and fresh else causal_mask(positions, max(starts) + t_max)  # [B, T, S]
            if self.plain:
                out = self.model(ids, positions, positions, mask, keep, self.hidden_layers, True)  # [B, n, V] float32
            else:
                out = self.model(ids, positions, positions, mask, keep)  # [B, n, V] float32
        if self.hidden_layers is not None:
            out, self._hidden = out  # logits, hidden states at every fed column [B, T, len * hidden]
        for b, r in enumerate(rows):
            self.held[b].extend(r)
        if logits is Logits.ALL:
            return [out[b, : lengths[b]] for b in range(len(rows))]
        return [out[b, :1] if lengths[b] and logits is Logits.LAST else out[b, :0] for b in range(len(rows))]

    def _chunked_forward(self, ids: Tensor, positions: Tensor, keep: Tensor | None, progress, start: int) -> Tensor:
        """A long feed through a model that only runs whole forwards (a tensor-parallel
        group): chunk after chunk of PREFILL_CHUNK tokens, the logits of `keep` [B, n]
        (query indices of the whole feed; None: all) gathered from the chunks they fall in.
        `start`: the longest row's held tokens, so chunk [a, b) attends over slots
        [0, start + b) without reading a position back from the device."""
        T = ids.shape[1]
        parts = []
        for a in range(0, T, PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, T)
            pos = positions[:, a:b]  # [B, C]
            inside = None if keep is None else keep.clamp(a, b - 1) - a  # [B, n] indices into the chunk
            parts.append((a, b, self.model(ids[:, a:b], pos, pos, causal_mask(pos, start + b), inside)))
            if progress is not None:
                progress(b, T)
        if keep is None:
            return torch.cat([out for _, _, out in parts], dim=1)  # [B, T, V]
        result = parts[0][2].clone()  # [B, n, V]
        for a, b, out in parts[1:]:
            here = (keep >= a) & (keep < b)  # [B, n]
            result = torch.where(here[..., None], out, result)
        return result

    def _kept_positions(self, lengths: list[int], logits: Logits) -> Tensor | None:
        if logits is Logits.ALL:
            return None
        if logits is Logits.NONE:
            return torch.zeros(len(lengths), 0, dtype=torch.long, device=self.device)  # [B, 0]
        last = [max(n - 1, 0) for n in lengths]
        return self.site.upload(last, self.device)[:, None]  # [B, 1]

    def graph_report(self, since: dict | None = None) -> dict:
        """Runner.graph_report (backends.torch.graphs.graph_report)."""
        return graph_report(self, since)

    # ------------------------------------------------------------------ device steps
    def begin_steps(self) -> None:
        """Start decoding with `step`: each row's length is what `feed` left cached."""
        self.lengths.copy_(torch.tensor([len(h) for h in self.held], dtype=torch.long))
        self._count_begin()

    @torch.inference_mode()
    def step(self, ids: Tensor, bound: int | None = None, at: Tensor | None = None) -> Tensor:
        """ids [B, T] long on the device, written at positions lengths..lengths+T-1 of
        each row -> logits [B, T, V] float32 (a static buffer under graphs: read it
        before the next step). `bound`: a host-known bound on max(lengths) + T, which
        limits the attention span (None: every slot a call may use). `lengths` does not
        move: call `advance`. `held` is not kept up to date by steps. `at` [B] long on
        the device: only column at[b] of each row reaches the lm_head -> logits [B, V]
        (a graph of its own per shape; a tensor-parallel group computes every column and
        gathers). Under graphs the step runs padded (shapes.py): B rows up to a bucket of
        the cache's rows, and a step `at` (a draft's catch-up, T = 1..32) to a bucket of
        widths when `bound` leaves room for the padded columns' writes."""
        B, T = ids.shape
        graphed = self.graphs is not None
        rows = min(bucket(B), self.rows) if graphed else B
        limit = rounded_slots(self.num_slots)
        width = T
        if graphed and at is not None and bound is not None and bound + bucket(T) - T <= limit:
            width = bucket(T)
        span = limit if bound is None else bound + width - T
        if graphed or self.device.type == "cuda":
            span = min(bucket_span(span), limit)  # few shapes to capture
        self._ensure(span)
        if width > self.state.offsets.numel():  # wider than any step so far
            self._new_state(self.state.lengths.numel(), width)
            self._graphs_invalid()
        if self.state.hidden is not None:  # what the step writes there (the caller reads `hidden()`)
            self._hidden = self.state.hidden[:B, : 1 if at is not None else T]
        layers = self.hidden_layers
        ids = padded(ids, rows, width)  # [rows, width]
        at = None if at is None else padded(at, rows)  # [rows]
        if graphed and self.plain and at is None:
            step = lambda ids: self._step(ids, span)  # noqa: E731 - span is part of the key
            return self.graphs.run(("step", rows, width, span, layers), step, ids=ids)[:B]
        if graphed and self.plain:
            step_at = lambda ids, at: self._step(ids, span, at)  # noqa: E731
            return self.graphs.run(("step-at", rows, width, span, layers), step_at, ids=ids, at=at)[:B]
        return self._step(ids, span, at)[:B]

    def warm_up(self, batch_size: int, widths: Sequence[int], at_widths: Sequence[int] = ()) -> int:
        """Runner.warm_up (shapes.warm_steps); nothing without graphs."""
        return 0 if self.graphs is None else warm_steps(self, batch_size, widths, at_widths)

    def _new_state(self, batch: int, width: int) -> None:
        """A DecodeState for `batch` rows and steps up to `width` tokens (its hidden buffer as
        wide as keep_hidden asks); rows keep their lengths when the batch size stays."""
        width_hidden = len(self.hidden_layers) * self.loaded.args.hidden_size if self.hidden_layers else 0
        old, self.state = self.state.lengths, DecodeState(batch, width, self.device, width_hidden, self.loaded.dtype)
        if old.numel() == batch:
            self.state.lengths.copy_(old)

    def keep_hidden(self, layers: HiddenLayers | None) -> None:
        """Runner.keep_hidden: steps then write the hidden states into the state's static
        buffer (captured steps too: the buffer is registered); a tensor-parallel group
        cannot give them (UsageError)."""
        layers = tuple(layers) if layers else None
        if layers == self.hidden_layers:
            return
        if layers is not None and not self.plain:
            raise UsageError(
                "a drafter that reads the target's hidden states needs a target on one device",
                "drop the extra --target-device entries, or use a draft model",
            )
        bad = [i for i in layers or () if not (i == FINAL_HIDDEN or 0 <= i < len(self.model.layers))]
        if bad:
            raise ValueError(f"hidden layers {bad} are not layers of a {len(self.model.layers)}-layer model")
        self.hidden_layers, self._hidden = layers, None
        self._new_state(self.state.lengths.numel(), self.state.offsets.numel())
        self._graphs_invalid()  # steps now write (or no longer write) the hidden buffer

    def head_inputs(self) -> HeadInputs:
        """Runner.head_inputs: the model's embeddings, layers, width, lm_head and embedding
        scale (one device only)."""
        if not self.plain:
            raise UsageError(
                "a draft head needs a target on one device",
                "drop the extra --target-device entries, or use a draft model",
            )
        return shared_with_heads(self.model, self.loaded.args, self.loaded.dtype, lambda: len(self.held))

    def hidden(self) -> Tensor:
        """Runner.hidden: the last feed's or step's hidden states (keep_hidden)."""
        if self._hidden is None:
            raise RuntimeError("no hidden states kept: call keep_hidden() before the feed or step")
        return self._hidden

    def end_steps(self, kept) -> None:
        """Rows in `kept` hold the tokens their first steps wrote (Runner.end_steps); steps
        never change `held`, so the other rows hold what they held."""
        for row, tokens in kept.items():
            self.held[row].extend(tokens)
        self._count_end()

    @torch.inference_mode()
    def advance(self, n: Tensor | int, host: Sequence[int] | None = None) -> None:
        """lengths += n ([B] long on the device, or one int for every row), in place;
        `host`: the same counts on the host (Runner.advance)."""
        self.lengths.add_(n)
        self._count_advance(n, host)

    def _step(self, ids: Tensor, span: int, at: Tensor | None = None) -> Tensor:
        """Attention over slots [0, span), masked causally on the device (capturable);
        logits [B, T, V], or [B, V] at column at[b] of each row."""
        positions = self.state.lengths[: ids.shape[0], None] + self.state.offsets[: ids.shape[1]]  # [B, T]
        mask = causal_mask(positions, span)  # [B, T, S]
        if not self.plain:  # a tensor-parallel group captures the forward on every rank
            logits = self.model(ids, positions, positions, mask, capture=True)  # [B, T, V]
            return logits if at is None else logits[torch.arange(ids.shape[0], device=ids.device), at]
        keep = None if at is None else at[:, None]  # [B, 1]
        if self.hidden_layers is None:
            logits = self.model(ids, positions, positions, mask, keep)  # [B, T or 1, V]
        else:
            logits, states = self.model(ids, positions, positions, mask, keep, self.hidden_layers)
            self.state.hidden[: states.shape[0], : states.shape[1]].copy_(states)  # [B, T or 1, n * hidden], in place
        return logits if at is None else logits[:, 0]  # [B, T, V] or [B, V]

    # ------------------------------------------------------------------ trees (SSD)
    @torch.inference_mode()
    def forward_raw(
        self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, out: Tensor | None = None
    ) -> Tensor:
        """Tree step with explicit positions/slots/mask ([B, T] x3, [B, T, S], on the
        device); does not touch `held`. Returns logits [B, T, V] float32 on the device,
        which the caller owns; with `out` [B, W, V] the first W queries' logits are copied
        there from the step's output (a static buffer under graphs: no clone of it). Under
        graphs the B rows are padded to a bucket of the cache's rows (a padded row sees
        slot 0 only)."""
        self._ensure(mask.shape[-1])
        B = ids.shape[0]
        if self.graphs is not None:
            rows = min(bucket(B), self.rows)
            ids, positions, slots = (padded(t, rows) for t in (ids, positions, slots))  # [rows, T] each
            mask = padded_tree_mask(mask, rows)  # [rows, T, S]
        if not self.plain:
            logits = self.model(ids, positions, slots, mask, capture=True)[:B]  # [B, T, V]
        elif self.graphs is not None:
            logits = self.graphs.run(
                ("tree", *mask.shape), self.model, input_ids=ids, positions=positions, slots=slots, attn_mask=mask
            )[:B]  # [B, T, V], a static buffer (capture.py)
        else:
            return kept_logits(self.model(ids, positions, slots, mask), out)  # [B, T, V]
        if out is None:
            return logits if self.graphs is None else logits.clone()
        return kept_logits(logits, out)

    def tree_span(self, needed: int) -> int | None:
        """Runner.tree_span: `needed` in the decode steps' span buckets, within the rows'
        slots (None where that is every slot anyway)."""
        span = bucket_span(needed) if self.graphs is not None or self.device.type == "cuda" else needed
        return span if span < self.num_slots else None

    def tree_width(self, width: int) -> int:
        """Tree steps of `width` branches are padded to this many (graph buckets)."""
        return bucket(width) if self.graphs is not None else width

    @torch.inference_mode()
    def take_branch(self, row: int, src: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        """Copy the k/v of scratch slots `src` to slots start.. and record `tokens` there."""
        if len(src) != len(tokens):
            raise ValueError(f"{len(src)} slots for {len(tokens)} tokens")  # a caller bug
        dst = torch.arange(start, start + len(src), device=self.device)  # [n]
        self.model.copy_slots(row, self.site.upload(list(src), self.device), dst)
        held = self.held[row]
        del held[start:]
        held.extend(tokens)
