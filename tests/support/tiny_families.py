"""Tiny random checkpoints of the families beyond the llama family, written with
transformers' own classes (float32, the suite's tokenizer), one builder per family.

`FAMILIES` maps a family's test name to (its builder, the transformers class that is its
reference). Each builder writes a checkpoint directory like a published one and returns it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def _save(model, out_dir: Path, tokenizer_dir: Path, eos: int = 0) -> Path:
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out_dir / f.name)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    model.save_pretrained(out_dir)
    return out_dir


def _vocab(tokenizer_dir: Path) -> int:
    import json

    return len(json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"])


def make_qwen3_moe(out_dir: Path, tokenizer_dir: Path, seed: int = 20, **changes) -> Path:
    """Qwen3-MoE: 8 experts, 2 per token, the second layer dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(
        vocab_size=_vocab(tokenizer_dir),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**fields, **changes})).eval(), out_dir, tokenizer_dir)


def make_gemma3(out_dir: Path, tokenizer_dir: Path, seed: int = 21, **changes) -> Path:
    """Gemma 3: three local layers (window 8) and one global layer, linear rope scaling on
    the global table, soft-capped logits, tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fields = dict(
        vocab_size=_vocab(tokenizer_dir),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**fields, **changes})).eval()
    _randomize_norms(model, seed)
    return _save(model, out_dir, tokenizer_dir)


def make_gemma4(out_dir: Path, tokenizer_dir: Path, seed: int = 22, **changes) -> Path:
    """Gemma 4 with what its published configs use: local layers (window 8) and global ones
    with wider heads, their own kv heads, keys as values and a proportional rotary table;
    per-layer embeddings; the last two layers (one of each type) reading earlier layers'
    caches with double-wide MLPs; soft-capped logits, tied embeddings."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    fields = dict(
        vocab_size=_vocab(tokenizer_dir),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,  # local layers: one query head per kv head; global: two
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=_vocab(tokenizer_dir),
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**fields, **changes})).eval()
    _randomize_norms(model, seed)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
    return _save(model, out_dir, tokenizer_dir)


def _randomize_norms(model, seed: int) -> None:
    """Norm weights drawn around their init (transformers starts them at 0 or 1), so a
    norm whose offset or cast is wrong changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


Builder = Callable[..., Path]

# test name -> (builder, the transformers class that loads it as the reference)
FAMILIES: dict[str, tuple[Builder, str]] = {
    "qwen3_moe": (make_qwen3_moe, "Qwen3MoeForCausalLM"),
    "gemma3": (make_gemma3, "Gemma3ForCausalLM"),
    "gemma4": (make_gemma4, "Gemma4ForCausalLM"),
}
