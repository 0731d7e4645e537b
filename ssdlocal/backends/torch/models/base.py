"""The causal LM every family builds on: embeddings, decoder layers, final norm and lm_head
over a static KV cache of slots with arbitrary masks.

Callers say which slot each new token's k/v goes to and which slots each query may see,
so linear decoding, batches with per-row positions and fan-out trees all use one forward.
A family (one file per family in this package) supplies its args (`ModelArgs` and what it
adds) and its decoder layer; here are what they share: the caches and rotary tables, the
per-forward masks (a sliding-window layer gets the window's), the chunked prefill, the
prefix pool and the head (logits, and hidden states for drafters that read them).
transformers supplies config parsing (in the family's args); this package knows nothing
about files.

A decoder layer is an nn.Module with `rope` (which rotary table it reads), forward(x, cos,
sin, slots, mask), unless it is a linear-attention layer (a hybrid family keeps those
layers' states itself) `self_attn` (an Attention: its kv_cache, heads and window), plus
its own slice of the model's per-layer inputs when the family has them (`layer_inputs`).
A layer whose `kv_source` names an earlier layer holds no cache: its attention reads that
layer's (Gemma 4's shared KV), so caches, the prefix pool and slot copies are per owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ssdlocal.backends.base import FINAL_HIDDEN, HiddenLayers
from ssdlocal.backends.torch.attention import AttentionMask, chunk_kernel
from ssdlocal.backends.torch.kvcache import KVCache, KVPool, check_room
from ssdlocal.backends.torch.logits import fp32_logits
from ssdlocal.backends.torch.models.layers import LayerArgs, RMSNorm, rope_inv_freq, rope_tables
from ssdlocal.backends.torch.scratch import ScratchPool
from ssdlocal.core.memory import allocating
from ssdlocal.backends.torch.models.fields import read_rope, refuse  # noqa: F401 - the families import them from here

# A chunked prefill keeps every chunk's boolean mask for all layers while they fit in this
# (B x sum of chunk x span bytes: a 20k-token prompt); past it each layer builds its own.
MASK_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class ModelArgs(LayerArgs):
    """What every family reads from its config (its layers' LayerArgs, then these); a family's
    args subclass adds its own."""

    arch: str  # the name of its Architecture (weights/formats/arch.py)
    vocab_size: int
    num_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    def ropes(self) -> dict[str, tuple[int, float, dict | None]]:
        """The rotary tables the layers read, by name: (rotary dims, theta, scaling)."""
        return {"global": (self.head_dim, self.rope_theta, self.rope_scaling)}

    @property
    def window(self) -> int | None:
        """The sliding window of the model's windowed layers (None: no layer has one)."""
        return None

    @property
    def tensor_parallel_sizes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of everything tensor parallelism divides (parallel/tp.py checks)."""
        return (
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        )


def causal_mask(positions: Tensor, S: int) -> Tensor:
    """Linear-case mask [B, T, S]: slot s visible iff s <= position (slot == position)."""
    slots = torch.arange(S, device=positions.device)  # [S]
    return slots[None, None, :] <= positions[:, :, None]  # [B, T, S]


def kept(x: Tensor, keep: Tensor | None) -> Tensor:
    """x [B, T, H] at query indices `keep` [B, n] (None: every position)."""
    return x if keep is None else x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))  # [B, n, H]


class CausalLM(nn.Module):
    """Module names are ours (weights/formats/arch.py's tables); each architecture's
    description maps its files' tensor names to them. Subclasses build `layers` in
    `make_layer` and may scale the embeddings (`embed_scale`) or cap the logits
    (`final_softcap`)."""

    embed_scale: float | None = None  # embeddings times this (cast to the activation dtype first)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    norm_type: Callable[[int, float], nn.Module] = RMSNorm  # the family's norm, from (width, eps)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(args.num_layers))
        self.norm = self.make_norm()
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ropes = args.ropes()
        # Rotary tables [P, R] float32 per name, P >= every position a step can use (the
        # context, and the cache's slots: drafts of the last round may pass the context); set
        # by setup_cache, grown by grow_cache. Buffers: captured steps read them.
        for name in self.ropes:
            self.register_buffer(f"rope_cos_{name}", None, persistent=False)
            self.register_buffer(f"rope_sin_{name}", None, persistent=False)
        # The position each cache slot holds [B, slots] (windowed models: a window mask needs
        # it where tree scratch slots hold other positions than their index); None otherwise.
        self.register_buffer("slot_positions", None, persistent=False)
        self.num_slots = 0
        self.prefix_pool: KVPool | None = None  # stored prefixes (setup_prefix_pool); steps never read it

    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def make_norm(self) -> nn.Module:
        return self.norm_type(self.args.hidden_size, self.args.rms_norm_eps)

    # ------------------------------------------------------------------ caches
    def _owners(self) -> list[nn.Module]:
        """The layers that hold a cache of their own (attention not reading another's: `kv_source`)."""
        return [
            layer for layer in self.layers if hasattr(layer, "self_attn") and getattr(layer, "kv_source", None) is None
        ]

    def _layer_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head width) of each owner's cache (per rank under TP)."""
        return [(layer.self_attn.n_kv_heads, layer.self_attn.head_dim) for layer in self._owners()]

    def setup_cache(self, batch_size: int, num_slots: int, dtype, device) -> None:
        """Allocate one KVCache per owning layer (its kv heads: per rank under TP)."""
        old = sum(layer.self_attn.kv_cache.nbytes for layer in self._owners() if layer.self_attn.kv_cache)
        self._check_caches(batch_size, num_slots, dtype, device, freed=old)
        for layer in self._owners():
            layer.self_attn.kv_cache = None  # free the old cache before allocating
        self.use_caches(self._allocate_caches(batch_size, num_slots, dtype, device))

    def new_caches(self, batch_size: int, num_slots: int, dtype, device) -> list[KVCache]:
        """One KVCache per owning layer, not installed (`use_caches`): a cache beside the batch's."""
        self._check_caches(batch_size, num_slots, dtype, device)
        return self._allocate_caches(batch_size, num_slots, dtype, device)

    def _check_caches(self, batch_size: int, num_slots: int, dtype, device, freed: int = 0) -> None:
        need = sum(KVCache.bytes_for(batch_size, h, num_slots, d, dtype) for h, d in self._layer_shapes())
        check_room(need, device, f"KV cache of {batch_size} x {num_slots} slots", freed=freed)

    def _allocate_caches(self, batch_size: int, num_slots: int, dtype, device) -> list[KVCache]:
        """One KVCache per owning layer, and rotary tables that cover their slots."""
        with allocating(f"allocating the KV cache of {batch_size} x {num_slots} slots on {device}"):
            caches = [KVCache(batch_size, h, num_slots, d, dtype, device) for h, d in self._layer_shapes()]
        self._cover_positions(max(self.args.max_position_embeddings, num_slots), torch.device(device))
        return caches

    def use_caches(self, caches: list[KVCache]) -> None:
        """Install `caches` (one per owning layer, as `caches()` or `new_caches` gave them)."""
        for layer, cache in zip(self._owners(), caches, strict=True):
            layer.self_attn.kv_cache = cache
        self._share_caches()
        self.num_slots = caches[0].num_slots
        self._new_slot_positions(caches[0].k.shape[0], self.num_slots, caches[0].k.device)

    def _share_caches(self) -> None:
        """Point each layer with a `kv_source` at its source's cache (it writes none)."""
        for layer in (layer for layer in self.layers if getattr(layer, "kv_source", None) is not None):
            layer.self_attn.kv_cache = self.layers[layer.kv_source].self_attn.kv_cache

    def _new_slot_positions(self, batch: int, slots: int, device, keep: Tensor | None = None) -> None:
        """Windowed models: each slot's position, its index until a step writes another."""
        if self.args.window is None:
            return
        positions = torch.arange(slots, device=device).repeat(batch, 1)  # [B, S]
        if keep is not None:
            positions[:, : keep.shape[1]] = keep
        self.slot_positions = positions

    def _cover_positions(self, n_pos: int, device: torch.device) -> None:
        """Rotary tables for positions [0, n_pos) on `device` (kept when they already are)."""
        for name, (dim, theta, scaling) in self.ropes.items():
            cos = getattr(self, f"rope_cos_{name}")
            if cos is not None and cos.shape[0] >= n_pos and cos.device == device:
                continue
            inv_freq, factor = rope_inv_freq(dim, theta, scaling)  # [R/2]
            cos, sin = rope_tables(inv_freq, factor, n_pos, device)  # [P, R] each
            setattr(self, f"rope_cos_{name}", cos)
            setattr(self, f"rope_sin_{name}", sin)

    def rope_tables(self) -> tuple[Tensor, ...]:
        """Every rotary table (cos, sin per name): what captured steps read besides the caches."""
        return tuple(getattr(self, f"rope_{kind}_{name}") for name in self.ropes for kind in ("cos", "sin"))

    def state_buffers(self) -> tuple[Tensor, ...]:
        """The buffers the model reallocates (rotary tables, slot positions): a captured
        step's owner compares them before each replay."""
        extra = (self.slot_positions,) if self.slot_positions is not None else ()
        return (*self.rope_tables(), *extra)

    def grow_cache(self, num_slots: int) -> None:
        """Enlarge every owning layer's KV cache to `num_slots`, keeping what it holds."""
        first = self._owners()[0].self_attn.kv_cache
        batch, device, dtype = first.k.shape[0], first.k.device, first.k.dtype
        what = f"KV cache of {batch} x {num_slots} slots"
        need = sum(KVCache.bytes_for(batch, h, num_slots, d, dtype) for h, d in self._layer_shapes())
        check_room(need, device, what)
        with allocating(f"growing the {what} on {device}"):
            for layer in self._owners():  # one at a time: the old and new cache of only one layer coexist
                layer.self_attn.kv_cache = layer.self_attn.kv_cache.grown(num_slots)
        self._share_caches()
        self.num_slots = num_slots
        self._new_slot_positions(batch, num_slots, device, keep=self.slot_positions)
        self._cover_positions(num_slots, device)  # a slot index never exceeds a position's

    def caches(self) -> list[KVCache]:
        """The owning layers' caches (a layer with a `kv_source` reads its source's)."""
        return [layer.self_attn.kv_cache for layer in self._owners()]

    def prefix_pool_bytes(self, tokens: int, dtype) -> int:
        return KVPool.bytes_for(self._layer_shapes(), tokens, dtype)

    def setup_prefix_pool(self, tokens: int, dtype, device) -> None:
        """Room for `tokens` stored prefix tokens of every layer (0: none)."""
        self.prefix_pool = None
        if tokens:
            with allocating(f"allocating the prefix cache of {tokens} tokens on {device}"):
                self.prefix_pool = KVPool(self._layer_shapes(), tokens, dtype, device)

    def save_prefix(self, row: int, runs: list[tuple[int, int, int]]) -> None:
        """Row `row`'s k/v -> the prefix pool, every layer; runs (first slot, first pool token, length)."""
        assert self.prefix_pool is not None  # the runner keeps no store without a pool
        self.prefix_pool.save(self.caches(), row, runs)

    def load_prefix(self, row: int, runs: list[tuple[int, int, int]]) -> None:
        """The prefix pool -> row `row`'s k/v, every layer; runs (first slot, first pool token, length).
        A row's own slots hold the positions of their index."""
        assert self.prefix_pool is not None
        self.prefix_pool.load(self.caches(), row, runs)
        if self.slot_positions is not None:
            for slot, _, n in runs:
                self.slot_positions[row, slot : slot + n] = torch.arange(
                    slot, slot + n, device=self.slot_positions.device
                )

    def copy_slots(self, row: int, src: Tensor, dst: Tensor) -> None:
        """Copy row `row`'s cached k/v (and their positions) from slots `src` [n] to `dst` [n]."""
        for layer in self._owners():  # KV caches only (a hybrid's `caches()` adds its states)
            layer.self_attn.kv_cache.copy_slots(row, src, dst)
        if self.slot_positions is not None:
            self.slot_positions[row, dst] = self.slot_positions[row, src]

    # ------------------------------------------------------------------ forward
    def _embed(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        if self.embed_scale is not None:  # float32, then the activation dtype (as transformers rounds it);
            # made by an op, so a captured step holds no tensor constant
            x = x * torch.full((), self.embed_scale, device=x.device).to(x.dtype)
        return x

    def layer_inputs(self, input_ids: Tensor, x: Tensor) -> Tensor | None:
        """Inputs [B, T, layers, width] of tokens `input_ids` embedded as `x`, layer i's slice
        passed to it after its mask (Gemma 4's per-layer embeddings); None: the family has none."""
        return None

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """Each table's cos and sin at `positions` [B, T] -> [B, 1, T, R] each."""
        out = {}
        for name in self.ropes:
            cos, sin = getattr(self, f"rope_cos_{name}"), getattr(self, f"rope_sin_{name}")
            out[name] = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
        return out

    @staticmethod
    def mask_kind(layer: nn.Module) -> tuple[bool, int]:
        """Which of a forward's masks a layer reads: (windowed, query heads per kv head);
        a linear-attention layer reads none: (False, 0), a kind no mask is built for."""
        attn = getattr(layer, "self_attn", None)
        return (False, 0) if attn is None else (attn.window is not None, attn.n_heads // attn.n_kv_heads)

    def _masks(
        self, attn_mask: Tensor | None, positions: Tensor, slots: Tensor, dtype: torch.dtype
    ) -> dict[tuple[bool, int], AttentionMask | None]:
        """The forward's masks, by `mask_kind`: `attn_mask` [B, T, S] bool (None: a fresh
        causal prefill), and for windowed layers the same without slots whose position is a
        window or more behind the query's; each in the form of its layers' head groups."""
        kinds = {self.mask_kind(layer) for layer in self.layers if hasattr(layer, "self_attn")}
        window = self.args.window
        if window is None:
            return {k: None if attn_mask is None else AttentionMask.build(attn_mask, k[1], dtype) for k in kinds}
        full = attn_mask
        if attn_mask is None:
            T = positions.shape[1]
            attn_mask = causal_mask(positions - positions[:, :1], T)  # [B, T, T]: the new tokens
            held = positions  # slot t holds position t of the feed
        else:
            assert self.slot_positions is not None  # windowed models keep them (use_caches)
            rows = self.slot_positions[: slots.shape[0]]  # the batch's: the cache may hold more rows
            rows.scatter_(1, slots, positions)  # what this forward writes
            held = rows[:, : attn_mask.shape[-1]]  # [B, S]
        near = held[:, None, :] > positions[:, :, None] - window  # [B, T, S]
        masks = {False: full, True: attn_mask & near}  # [B, T, S] each (full None: fresh)
        return {
            (w, groups): None if masks[w] is None else AttentionMask.build(masks[w], groups, dtype)
            for w, groups in kinds
        }

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        attn_mask: Tensor | None,
        keep: Tensor | None = None,
        hidden: HiddenLayers | None = None,
        hidden_all: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids/positions/slots [B, T] long, attn_mask [B, T, S] bool (or None for a
        fresh causal prefill) -> logits [B, T, V] float32; with `keep` [B, n] long (query
        indices), only those positions reach the lm_head: logits [B, n, V]. With `hidden`
        (backends.base.HiddenLayers): (logits, those hidden states [B, T or n, len * hidden]:
        at `keep`, or at every position with `hidden_all`).

        Every query must see at least one slot (callers give padded queries their own
        slot or a trash slot); an all-false mask row would turn into NaN.
        """
        if not self.ropes or getattr(self, f"rope_cos_{next(iter(self.ropes))}") is None:
            raise RuntimeError("call setup_cache() before forward()")
        x = self._embed(input_ids)  # [B, T, hidden]
        extra = self.layer_inputs(input_ids, x)  # [B, T, layers, width] or None
        rotary = self._rotary(positions, x.dtype)
        masks = self._masks(attn_mask, positions, slots, x.dtype)
        outputs: dict[int, Tensor] = {}  # layer i -> its output, for `hidden`
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[layer.rope]
            own = () if extra is None else (extra[:, :, i],)  # [B, T, width]
            x = layer(x, cos, sin, slots, masks.get(self.mask_kind(layer)), *own)  # [B, T, hidden]
            if hidden is not None and i in hidden:
                outputs[i] = x
        return self._head(x, keep, hidden, outputs, hidden_all)

    def _head(
        self,
        x: Tensor,
        keep: Tensor | None,
        hidden: HiddenLayers | None,
        outputs: dict[int, Tensor],
        hidden_all: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The last layer's output x [B, T, hidden] -> logits at `keep` (None: every
        position), and with `hidden` the asked states at the same positions (every
        position with `hidden_all`)."""
        normed = self.norm(kept(x, keep))  # [B, n, hidden]
        logits = fp32_logits(self.lm_head, normed)  # [B, n, V]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap  # [B, n, V]
        if hidden is None:
            return logits
        where = None if hidden_all else keep
        final = self.norm(x) if hidden_all and keep is not None else normed  # [B, T or n, hidden]
        states = [final if i == FINAL_HIDDEN else kept(outputs[i], where) for i in hidden]  # each [B, T or n, hidden]
        return logits, torch.cat(states, dim=-1)  # [B, T or n, len * hidden]

    def prefill(
        self,
        input_ids: Tensor,
        positions: Tensor,
        keep: Tensor | None,
        chunk: int,
        fresh: bool = False,
        dense: torch.dtype | None = None,
        progress: Callable[[int, int], None] | None = None,
        starts: Sequence[int] | None = None,
        hidden: HiddenLayers | None = None,
        hidden_all: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """A long feed, one layer at a time: input_ids/positions [B, T] long (each token's
        k/v goes to the slot of its position) -> logits [B, n, V] at `keep` [B, n] (None:
        every position); with `hidden`, (logits, those hidden states) as `forward` gives them.

        Each layer reads the T tokens in chunks of `chunk`, so the attention mask and the
        MLP's activations are bounded by the chunk, not the prompt; a chunk attends to the
        cache's slots up to its positions (earlier calls' tokens and earlier chunks).
        `fresh`: rows start at slot 0 with equal lengths, so the first chunk needs no mask.
        `starts`: each row's first position (host ints; None: read from `positions` once),
        so no (layer, chunk) waits on the device for its span. On CUDA a chunk runs a
        causal kernel aligned to the lower right (attention.py), with no mask at all; on
        the CPU a boolean mask [B, 1, C, S] per chunk, built from host spans by the first
        layer and kept for the others while all chunks' masks fit in MASK_CACHE_BYTES
        (else built per layer and chunk). A windowed layer always gets its chunk's mask.
        `dense`: modules that offer `expanded()` (quantized linears) hold their weights
        dense in this dtype for the layer's chunks, computed once per layer (None: not). `progress(done, total)` is
        called after every (layer, chunk) in units of chunk tokens; if it raises, the feed
        stops there (what was written past the callers' held tokens is never read).
        """
        if getattr(self, f"rope_cos_{next(iter(self.ropes))}") is None:
            raise RuntimeError("call setup_cache() before prefill()")
        B, T = input_ids.shape
        x = self._embed(input_ids)  # [B, T, hidden]
        extra = self.layer_inputs(input_ids, x)  # [B, T, layers, width] or None
        rotary = self._rotary(positions, x.dtype)
        if starts is None:
            starts = positions[:, 0].tolist()  # the call's one read-back (callers pass them)
        first = list(starts)
        lower_right = chunk_kernel(x.device.type) == "lower-right"
        windowed = self.args.window is not None
        chunks = [(a, min(a + chunk, T)) for a in range(0, T, chunk)]
        mask_bytes = B * sum((b - a) * (max(first) + b) for a, b in chunks)  # every chunk's bool mask
        masks: dict | None = {} if mask_bytes <= MASK_CACHE_BYTES else None  # chunk -> its masks
        total, done = len(self.layers) * T, 0
        pool = ScratchPool()  # one layer's expanded weights, lent again to the next layer
        outputs: dict[int, Tensor] = {}  # layer i -> its output, for `hidden`
        for i, layer in enumerate(self.layers):
            with ExitStack() as stack:
                if dense is not None:
                    for module in layer.modules():
                        if hasattr(module, "expanded"):
                            stack.enter_context(module.expanded(pool, dense))
                for a, b in chunks:
                    pos = positions[:, a:b]  # [B, C]
                    kind = self.mask_kind(layer)
                    tensor = kind[0] or getattr(getattr(layer, "self_attn", None), "sinks", None) is not None
                    if fresh and a == 0 and not windowed:
                        mask = None
                    elif lower_right and not tensor and not (fresh and a == 0):
                        mask = AttentionMask.lower_right(tuple(s + b for s in first))  # no tensor
                    else:
                        found = masks.get(a) if masks is not None else None
                        if found is None:  # slots up to the chunk's newest token
                            found = self._masks(causal_mask(pos, max(first) + b), pos, pos, x.dtype)
                            if masks is not None:
                                masks[a] = found  # the next layers' chunk a sees the same slots
                        mask = found.get(kind)
                    cos, sin = rotary[layer.rope]
                    own = () if extra is None else (extra[:, a:b, i],)  # [B, C, width]
                    x[:, a:b] = layer(x[:, a:b], cos[:, :, a:b], sin[:, :, a:b], pos, mask, *own)  # [B, C, hidden]
                    done += b - a
                    if progress is not None:
                        progress(done, total)
            if hidden is not None and i in hidden:
                outputs[i] = x.clone()  # x is written in place by the next layers
        return self._head(x, keep, hidden, outputs, hidden_all)
