"""What a torch target shares with a draft head beside it (backends.base.HeadInputs): its
embeddings, lm_head and embedding scale, each layer's KV geometry and a reader of the KV
cache a layer reads (a layer with a kv_source reads that layer's). A hybrid target (layers
without attention: Qwen3.5's linear ones) shares no cache: no geometry, no reader."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from ssdlocal.backends.base import HeadInputs, LayerKV
from ssdlocal.core.errors import ModelLoadError


def shared_with_heads(model, args, dtype, rows: Callable[[], int]) -> HeadInputs:
    """HeadInputs of `model` (a CausalLM with `args`, run in `dtype`); `rows()` is the
    batch's row count when a head reads the cache (the cache may hold more rows)."""
    if not all(hasattr(layer, "self_attn") for layer in model.layers):  # linear layers keep no KV
        return HeadInputs(
            model.embed_tokens, args.num_layers, args.hidden_size, dtype, model.embed_scale, lm_head=model.lm_head
        )
    kv = []
    for i, layer in enumerate(model.layers):
        attn, source = layer.self_attn, getattr(layer, "kv_source", None)
        kv.append(LayerKV(attn.window, attn.n_kv_heads, attn.head_dim, i if source is None else source))

    def read_kv(layer: int) -> tuple[Tensor, Tensor]:
        """The batch's rows of the cache layer `layer` reads, as it is now."""
        cache, n = model.layers[layer].self_attn.kv_cache, rows()
        return cache.k[:n], cache.v[:n]

    return HeadInputs(
        model.embed_tokens,
        args.num_layers,
        args.hidden_size,
        dtype,
        model.embed_scale,
        tuple(kv),
        read_kv,
        model.lm_head,
    )


def check_state(head, state: Mapping[str, object], what: str, hint: str, shared: tuple[str, ...] = ()) -> None:
    """ModelLoadError naming what `state` lacks or has beyond `head`'s own tensors (those
    starting with a `shared` prefix come from the target); `what`: "{path} is not X" words."""
    expected = {k for k in head.state_dict() if not k.startswith(shared)} if shared else set(head.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(f"{what}: missing {missing[:5]}, unexpected {unexpected[:5]}", hint)
