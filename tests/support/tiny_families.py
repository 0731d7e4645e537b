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

# two rows of 12 token ids, for logits at every position (prefill_logits)
PREFILL_IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 51], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 200, 300]])


def prefill_logits(path, scheme="none", ids: torch.Tensor = PREFILL_IDS) -> torch.Tensor:
    """Float32 logits [B, T, V] at every position of `ids` [B, T], one masked prefill of the
    checkpoint at `path` as our torch backend loads it with quantization `scheme`."""
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.backends.torch.models import causal_mask

    model = load_model(path, "cpu", "float32", scheme).model
    B, T = ids.shape
    pos = torch.arange(T)[None].repeat(B, 1)
    with torch.inference_mode():
        model.setup_cache(B, 64, torch.float32, "cpu")
        return model(ids, pos, pos, causal_mask(pos, T))  # [B, T, V]


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


def make_gpt_oss(out_dir: Path, tokenizer_dir: Path, seed: int = 23, **changes) -> Path:
    """gpt-oss as published but small: sliding (window 8) and full layers alternating, YaRN
    rope (truncate False), 8 experts 2 per token, attention sinks; biases, sinks and norms
    drawn (transformers starts biases at 0) and a low swiglu_limit, so the clamps bite.
    Saved as transformers saves it: experts fused and transposed (MXFP4: write_mxfp4)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = dict(
        vocab_size=_vocab(tokenizer_dir),
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        swiglu_limit=1.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**fields, **changes})).eval()
    _randomize_norms(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_bias", ".bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return _save(model, out_dir, tokenizer_dir)


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (in a multiple of 32) -> MXFP4 (blocks [..., out, in/32, 16],
    scales [..., out, in/32] uint8): per block of 32 the power of two that brings its
    largest value to [4, 8) (6 is the largest code), each value rounded to the nearest code."""
    *lead, out, width = weight.shape
    groups = weight.float().reshape(*lead, out, width // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100))) - 2  # [..., out, G]
    scaled = groups / torch.exp2(exponent)[..., None]  # [..., out, G, 32]
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)  # [..., out, G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4(float_dir: Path, out_dir: Path) -> Path:
    """A copy of gpt-oss checkpoint `float_dir` with its experts' weights as published:
    MXFP4 blocks and scales, [E, out, ...] (quantization_config names mxfp4)."""
    import json

    from safetensors.torch import load_file, save_file

    out_dir = Path(shutil.copytree(float_dir, out_dir))
    state = load_file(out_dir / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(state.pop(name).transpose(1, 2))  # stored [E, in, out]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def fuse_experts(saved: Path, out_dir: Path) -> Path:
    """A copy of checkpoint `saved` (Qwen3-MoE or Qwen3.5-MoE, text-only or multimodal) with
    its experts stored fused, as transformers holds them and published Qwen3.5-MoE
    checkpoints store them: per layer `mlp.experts.gate_up_proj` [E, 2I, H] (every expert's
    gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], in place of
    `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    import re

    from safetensors.torch import load_file, save_file

    out_dir = Path(shutil.copytree(saved, out_dir))
    (file,) = out_dir.glob("*.safetensors")
    state = load_file(file)
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # "...mlp.experts." -> projection -> e -> weight
    for name in [n for n in state if re.search(r"\.experts\.\d+\.", n)]:
        prefix, e, projection = re.fullmatch(r"(.+\.experts\.)(\d+)\.(\w+)\.weight", name).groups()
        experts.setdefault(prefix, {}).setdefault(projection, {})[int(e)] = state.pop(name)
    for prefix, parts in experts.items():
        gate, up, down = (
            torch.stack([p[e] for e in sorted(p)]) for p in (parts[k] for k in ("gate_proj", "up_proj", "down_proj"))
        )
        state[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        state[prefix + "down_proj"] = down  # [E, H, I]
    save_file(state, file, metadata={"format": "pt"})
    return out_dir


def _randomize_norms(model, seed: int) -> None:
    """Norm weights drawn around their init (transformers starts them at 0 or 1), so a
    norm whose offset or cast is wrong changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


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
    "gemma3": (make_gemma3, "Gemma3ForCausalLM"),
    "gemma4": (make_gemma4, "Gemma4ForCausalLM"),
    "qwen3_5": (make_qwen3_5, "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": (make_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
    "gpt_oss": (make_gpt_oss, "GptOssForCausalLM"),
}
