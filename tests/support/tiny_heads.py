"""Tiny draft heads in their published formats, for a tiny target checkpoint.

`make_eagle3` writes an EAGLE-3 head directory (config.json + model.safetensors) as the
SafeAILab / SGLang / vLLM checkpoints are laid out: fc [H, 3H], midlayer.* (q/k/v over
2H), norm, lm_head over a reduced draft vocabulary, d2t (draft id -> target id offset), t2d.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_eagle3(
    out_dir: Path,
    target_dir: Path,
    seed: int = 40,
    draft_vocab: int = 200,
    aux=(1, 1, 2),
    heads: int = 4,
    kv: int = 2,
    inter: int | None = None,
) -> Path:
    """A random EAGLE-3 head for the target at `target_dir` (its width and vocabulary); the
    draft vocabulary is `draft_vocab` target ids spread over the vocabulary. `heads`, `kv`
    and `inter` (default 2 x width) shape its one layer (timing shapes use a real head's)."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    head_dim, inter = h // heads, inter or 2 * h
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    ids = torch.linspace(0, vocab - 1, draft_vocab).round().long().unique()  # sorted target ids
    state = {
        "fc.weight": rand(h, 3 * h, std=0.08),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rand(len(ids), h, std=0.5),
        "d2t": ids - torch.arange(len(ids)),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": len(ids),
        "max_position_embeddings": target["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out
