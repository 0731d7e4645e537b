"""Native Llama / Qwen2 / Qwen3 forward pass over a static KV cache with arbitrary masks.

The cache is a fixed array of slots; callers say which slot each new token's k/v
goes to and which slots each query may see, so linear decoding, batches with
per-row positions and fan-out trees all use one forward. What differs between the
architectures (biases, q/k norms) comes from their description (weights/formats/arch.py),
which also lists the module names used here. transformers is used only for config parsing
(by the loader); this module knows nothing about files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssdlocal.backends.base import FINAL_HIDDEN, HiddenLayers
from ssdlocal.backends.torch.attention import AttentionMask, attend, chunk_kernel
from ssdlocal.backends.torch.kvcache import KVCache, KVPool, check_room
from ssdlocal.backends.torch.logits import fp32_logits
from ssdlocal.backends.torch.scratch import ScratchPool
from ssdlocal.core.memory import oom_error
from ssdlocal.weights.formats.arch import for_hf_config, unsupported

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# A chunked prefill keeps every chunk's boolean mask for all layers while they fit in this
# (B x sum of chunk x span bytes: a 20k-token prompt); past it each layer builds its own.
MASK_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class ModelArgs:
    arch: str  # the name of its Architecture (arch.py): "llama" | "qwen2" | "qwen3" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3" | "linear", "factor": ..., ...}
    qkv_bias: bool  # qwen2: True
    qk_norm: bool  # qwen3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool
    max_position_embeddings: int
    o_bias: bool = False  # llama/qwen3 with attention_bias=True also bias o_proj

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        described = for_hf_config(cfg)
        arch = described.name
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise unsupported(f"{arch} with hidden_act={cfg.hidden_act!r}")
        if getattr(cfg, "mlp_bias", False):
            raise unsupported(f"{arch} with mlp_bias=True")
        if getattr(cfg, "use_sliding_window", False):
            raise unsupported(f"{arch} with use_sliding_window=True")

        # transformers 5 keeps theta and scaling together in rope_parameters; 4.x split them.
        rope = getattr(cfg, "rope_parameters", None)
        if rope:
            theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            scaling = dict(rope)
        else:
            theta = getattr(cfg, "rope_theta", 10000.0)
            scaling = dict(getattr(cfg, "rope_scaling", None) or {})
        scaling.pop("rope_theta", None)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise unsupported(f"{arch} with rope_type={rope_type!r}")
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}

        qkv_bias, o_bias = described.biases(bool(getattr(cfg, "attention_bias", False)))
        num_heads = cfg.num_attention_heads
        return cls(
            arch=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            qk_norm=described.qk_norm,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            o_bias=o_bias,
        )


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2] float32, as transformers computes them."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [D/2]
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]  # [D/2]
    elif scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq  # [D/2]
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # [D/2]
        smooth = (old_len / wavelen - low) / (high - low)  # [D/2]
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)  # [D/2]
        inv_freq = torch.where(is_medium, smoothed, scaled)  # [D/2]
    return inv_freq


def _kept(x: Tensor, keep: Tensor | None) -> Tensor:
    """x [B, T, H] at query indices `keep` [B, n] (None: every position)."""
    return x if keep is None else x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))  # [B, n, H]


def causal_mask(positions: Tensor, S: int) -> Tensor:
    """Linear-case mask [B, T, S]: slot s visible iff s <= position (slot == position)."""
    slots = torch.arange(S, device=positions.device)  # [S]
    return slots[None, None, :] <= positions[:, :, None]  # [B, T, S]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Same op order as transformers: normalize in float32, cast back, then scale.
        h = x.float()  # [..., dim]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., dim]
        return self.weight * h.to(x.dtype)  # [..., dim]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat((-x2, x1), dim=-1)  # [..., D]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.kv_cache: KVCache | None = None  # set by Transformer.setup_cache

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        """mask: which slots each query sees (AttentionMask). None: a fresh prefill
        (every row starts at slot 0, no padding): plain causal attention over the new tokens."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, T, H, D], [B, T, Hkv, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, D]
        q = q * cos + rotate_half(q) * sin  # [B, H, T, D]
        k = k * cos + rotate_half(k) * sin  # [B, Hkv, T, D]

        span = T if mask is None else mask.span
        keys, values = self.kv_cache.update(slots, k, v, span)  # [B, Hkv, S, D] each
        out = attend(q, k, v, keys, values, mask)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, hidden]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, hidden]


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: AttentionMask | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, mask)  # [B, T, hidden]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, hidden]


@contextmanager
def _allocating(doing: str) -> Iterator[None]:
    """An allocator failure inside becomes an OutOfMemoryError saying what was `doing`."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        mapped = oom_error(exc, doing)
        if mapped is None:
            raise
        raise mapped from exc


class Transformer(nn.Module):
    """Module names are ours (arch.py: GLOBAL_MODULES, BLOCK_MODULES); each architecture's
    description maps its files' tensor names to them."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE tables [P, D] float32, P >= every position a step can use (the context, and
        # the cache's slots: drafts of the last round may pass the context); set by
        # setup_cache, grown by grow_cache. Buffers: captured steps read them.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.num_slots = 0
        self.prefix_pool: KVPool | None = None  # stored prefixes (setup_prefix_pool); steps never read it

    def setup_cache(self, batch_size: int, num_slots: int, dtype, device) -> None:
        """Allocate one KVCache per layer (`args` head counts: per rank under TP)."""
        old = sum(layer.self_attn.kv_cache.nbytes for layer in self.layers if layer.self_attn.kv_cache)
        self._check_caches(batch_size, num_slots, dtype, device, freed=old)
        for layer in self.layers:
            layer.self_attn.kv_cache = None  # free the old cache before allocating
        self.use_caches(self._allocate_caches(batch_size, num_slots, dtype, device))

    def new_caches(self, batch_size: int, num_slots: int, dtype, device) -> list[KVCache]:
        """One KVCache per layer, not installed (`use_caches`): a cache beside the batch's."""
        self._check_caches(batch_size, num_slots, dtype, device)
        return self._allocate_caches(batch_size, num_slots, dtype, device)

    def _check_caches(self, batch_size: int, num_slots: int, dtype, device, freed: int = 0) -> None:
        a = self.args
        need = KVCache.bytes_for(batch_size, a.num_kv_heads, num_slots, a.head_dim, dtype) * len(self.layers)
        check_room(need, device, f"KV cache of {batch_size} x {num_slots} slots", freed=freed)

    def _allocate_caches(self, batch_size: int, num_slots: int, dtype, device) -> list[KVCache]:
        """One KVCache per layer, and RoPE tables that cover their slots."""
        a = self.args
        with _allocating(f"allocating the KV cache of {batch_size} x {num_slots} slots on {device}"):
            caches = [KVCache(batch_size, a.num_kv_heads, num_slots, a.head_dim, dtype, device) for _ in self.layers]
        self._cover_positions(max(a.max_position_embeddings, num_slots), torch.device(device))
        return caches

    def use_caches(self, caches: list[KVCache]) -> None:
        """Install `caches` (one per layer, as `caches()` or `new_caches` gave them)."""
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache
        self.num_slots = caches[0].num_slots

    def _cover_positions(self, n_pos: int, device: torch.device) -> None:
        """RoPE tables for positions [0, n_pos) on `device` (kept when they already are)."""
        if self.rope_cos is not None and self.rope_cos.shape[0] >= n_pos and self.rope_cos.device == device:
            return
        inv_freq = rope_inv_freq(self.args).to(device)  # [D/2]
        freqs = torch.arange(n_pos, device=device, dtype=torch.float)[:, None] * inv_freq  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.rope_cos, self.rope_sin = emb.cos(), emb.sin()  # [P, D] each

    def rope_tables(self) -> tuple[Tensor, Tensor]:
        return self.rope_cos, self.rope_sin

    def grow_cache(self, num_slots: int) -> None:
        """Enlarge every layer's KV cache to `num_slots`, keeping what it holds."""
        first = self.layers[0].self_attn.kv_cache
        batch, heads, _, dim = first.k.shape
        what = f"KV cache of {batch} x {num_slots} slots"
        check_room(KVCache.bytes_for(batch, heads, num_slots, dim, first.k.dtype), first.k.device, what)
        with _allocating(f"growing the {what} on {first.k.device}"):
            for layer in self.layers:  # one at a time: the old and new cache of only one layer coexist
                layer.self_attn.kv_cache = layer.self_attn.kv_cache.grown(num_slots)
        self.num_slots = num_slots
        self._cover_positions(num_slots, first.k.device)  # a slot index never exceeds a position's

    def caches(self) -> list[KVCache]:
        return [layer.self_attn.kv_cache for layer in self.layers]

    def prefix_pool_bytes(self, tokens: int, dtype) -> int:
        a = self.args
        return KVPool.bytes_for(len(self.layers), a.num_kv_heads, tokens, a.head_dim, dtype)

    def setup_prefix_pool(self, tokens: int, dtype, device) -> None:
        """Room for `tokens` stored prefix tokens of every layer (0: none)."""
        self.prefix_pool = None
        if tokens:
            with _allocating(f"allocating the prefix cache of {tokens} tokens on {device}"):
                a = self.args
                self.prefix_pool = KVPool(len(self.layers), a.num_kv_heads, tokens, a.head_dim, dtype, device)

    def save_prefix(self, row: int, runs: list[tuple[int, int, int]]) -> None:
        """Row `row`'s k/v -> the prefix pool, every layer; runs (first slot, first pool token, length)."""
        self.prefix_pool.save(self.caches(), row, runs)

    def load_prefix(self, row: int, runs: list[tuple[int, int, int]]) -> None:
        """The prefix pool -> row `row`'s k/v, every layer; runs (first slot, first pool token, length)."""
        self.prefix_pool.load(self.caches(), row, runs)

    def copy_slots(self, row: int, src: Tensor, dst: Tensor) -> None:
        """Copy row `row`'s cached k/v from slots `src` [n] to `dst` [n] in every layer."""
        for layer in self.layers:
            layer.self_attn.kv_cache.copy_slots(row, src, dst)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        attn_mask: Tensor | None,
        keep: Tensor | None = None,
        hidden: HiddenLayers | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids/positions/slots [B, T] long, attn_mask [B, T, S] bool (or None for a
        fresh causal prefill) -> logits [B, T, V] float32; with `keep` [B, n] long (query
        indices), only those positions reach the lm_head: logits [B, n, V]. With `hidden`
        (backends.base.HiddenLayers): (logits, those hidden states [B, T or n, len * hidden]).

        Every query must see at least one slot (callers give padded queries their own
        slot or a trash slot); an all-false mask row would turn into NaN.
        """
        if self.rope_cos is None:
            raise RuntimeError("call setup_cache() before forward()")
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        cos = self.rope_cos[positions].to(x.dtype)[:, None]  # [B, 1, T, D]
        sin = self.rope_sin[positions].to(x.dtype)[:, None]  # [B, 1, T, D]
        groups = self.args.num_heads // self.args.num_kv_heads
        mask = None if attn_mask is None else AttentionMask.build(attn_mask, groups, x.dtype)
        outputs: dict[int, Tensor] = {}  # layer i -> its output, for `hidden`
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, slots, mask)  # [B, T, hidden]
            if hidden is not None and i in hidden:
                outputs[i] = x
        return self._head(x, keep, hidden, outputs)

    def _head(
        self, x: Tensor, keep: Tensor | None, hidden: HiddenLayers | None, outputs: dict[int, Tensor]
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The last layer's output x [B, T, hidden] -> logits at `keep` (None: every
        position), and with `hidden` the asked states at the same positions."""
        x = _kept(x, keep)  # [B, n, hidden]
        normed = self.norm(x)  # [B, n, hidden]
        logits = fp32_logits(self.lm_head, normed)  # [B, n, V]
        if hidden is None:
            return logits
        states = [normed if i == FINAL_HIDDEN else _kept(outputs[i], keep) for i in hidden]  # each [B, n, hidden]
        return logits, torch.cat(states, dim=-1)  # [B, n, len * hidden]

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
        (else built per layer and chunk).
        `dense`: modules that offer `expanded()` (quantized linears) hold their weights
        dense in this dtype for the layer's chunks, computed once per layer (None: not). `progress(done, total)` is
        called after every (layer, chunk) in units of chunk tokens; if it raises, the feed
        stops there (what was written past the callers' held tokens is never read).
        """
        if self.rope_cos is None:
            raise RuntimeError("call setup_cache() before prefill()")
        B, T = input_ids.shape
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        cos = self.rope_cos[positions].to(x.dtype)[:, None]  # [B, 1, T, D]
        sin = self.rope_sin[positions].to(x.dtype)[:, None]  # [B, 1, T, D]
        groups = self.args.num_heads // self.args.num_kv_heads
        if starts is None:
            starts = positions[:, 0].tolist()  # the call's one read-back (callers pass them)
        first = list(starts)
        lower_right = chunk_kernel(x.device.type) == "lower-right"
        chunks = [(a, min(a + chunk, T)) for a in range(0, T, chunk)]
        mask_bytes = B * sum((b - a) * (max(first) + b) for a, b in chunks)  # every chunk's bool mask
        masks: dict[int, AttentionMask] | None = {} if mask_bytes <= MASK_CACHE_BYTES else None
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
                    mask = None
                    if lower_right and not (fresh and a == 0):
                        mask = AttentionMask.lower_right(tuple(s + b for s in first))  # no tensor
                    elif not (fresh and a == 0):
                        mask = masks.get(a) if masks is not None else None
                        if mask is None:  # slots up to the chunk's newest token
                            mask = AttentionMask.build(
                                causal_mask(pos, max(first) + b), groups, x.dtype
                            )  # [B, 1, C, S]
                            if masks is not None:
                                masks[a] = mask  # the next layers' chunk a sees the same slots
                    x[:, a:b] = layer(x[:, a:b], cos[:, :, a:b], sin[:, :, a:b], pos, mask)  # [B, C, hidden]
                    done += b - a
                    if progress is not None:
                        progress(done, total)
            if hidden is not None and i in hidden:
                outputs[i] = x.clone()  # x is written in place by the next layers
        return self._head(x, keep, hidden, outputs)
