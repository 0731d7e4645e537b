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


def _qwen3_5_fields(tokenizer_dir: Path) -> dict:
    """Four layers: linear, full, linear, linear attention (full attention in between, so
    states and KV both carry the sequence), grouped value heads (2 key heads, 4 value heads)."""
    return dict(
        vocab_size=_vocab(tokenizer_dir),
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def make_qwen3_5(out_dir: Path, tokenizer_dir: Path, seed: int = 21, **changes) -> Path:
    """Qwen3.5 dense: Gated DeltaNet and gated full attention, a SiLU MLP in every layer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {**_qwen3_5_fields(tokenizer_dir), "intermediate_size": 128}
    torch.manual_seed(seed)
    return _save(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**fields, **changes})).eval(), out_dir, tokenizer_dir)


def make_qwen3_5_moe(out_dir: Path, tokenizer_dir: Path, seed: int = 22, **changes) -> Path:
    """Qwen3.5-MoE: 8 experts, 2 per token, and a shared expert, in every layer."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = dict(
        _qwen3_5_fields(tokenizer_dir),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    torch.manual_seed(seed)
    return _save(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**fields, **changes})).eval(), out_dir, tokenizer_dir)


Builder = Callable[..., Path]

# test name -> (builder, the transformers class that loads it as the reference)
FAMILIES: dict[str, tuple[Builder, str]] = {
    "qwen3_moe": (make_qwen3_moe, "Qwen3MoeForCausalLM"),
    "qwen3_5": (make_qwen3_5, "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": (make_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
}
