"""Tiny multimodal checkpoints (transformers' *ForConditionalGeneration) of the families whose
published checkpoints are multimodal: Gemma 3, Gemma 4, Qwen3.5 and Qwen3.5-MoE. Each holds
the text model of a tiny text-only checkpoint (tests/support/tiny_families.py: its config
as `text_config`, its weights copied in) beside tiny image (and, for Gemma 4, audio)
towers with random weights, float32, saved with transformers' own `save_pretrained`.

`MULTIMODAL` maps a family's test name to (the text-only builder, the multimodal
architecture, its config's fields beside text_config). `other_layout` renames a saved checkpoint's
tensors into the other layout published checkpoints use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from support.tiny_families import make_gemma3, make_gemma4, make_qwen3_5, make_qwen3_5_moe

_SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
_GEMMA4_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "position_embedding_size": 64,
}
_GEMMA4_AUDIO = {
    "model_type": "gemma4_audio",
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [8, 4],
    "output_proj_dims": 16,
}
_QWEN_VISION = {
    "model_type": "qwen3_5_vision",
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,  # the text model's width
    "num_position_embeddings": 16,
}

# test name -> (text-only builder, multimodal architecture, config fields beside text_config)
MULTIMODAL = {
    "gemma3": (
        make_gemma3,
        "Gemma3ForConditionalGeneration",
        {"vision_config": _SIGLIP, "mm_tokens_per_image": 4},
    ),
    "gemma4": (
        make_gemma4,
        "Gemma4ForConditionalGeneration",
        {"vision_config": _GEMMA4_VISION, "audio_config": _GEMMA4_AUDIO},
    ),
    "qwen3_5": (make_qwen3_5, "Qwen3_5ForConditionalGeneration", {"vision_config": _QWEN_VISION}),
    "qwen3_5_moe": (make_qwen3_5_moe, "Qwen3_5MoeForConditionalGeneration", {"vision_config": _QWEN_VISION}),
}


def make_multimodal(
    name: str, out_dir: Path, tokenizer_dir: Path, text_dir: Path | None = None, **text_changes
) -> Path:
    """The multimodal checkpoint of family `name` whose text model is the text-only
    checkpoint `text_dir` (built here, with `text_changes`, when None)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    builder, architecture, extra = MULTIMODAL[name]
    out_dir = Path(out_dir)
    if text_dir is None:
        text_dir = builder(out_dir.with_name(out_dir.name + "_text"), tokenizer_dir, **text_changes)
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
    text_config = json.loads((Path(text_dir) / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text_config.pop(key, None)
    model_class = getattr(transformers, architecture)
    config_class = model_class.config_class
    config = config_class(
        text_config=text_config, tie_word_embeddings=text_config.get("tie_word_embeddings", False), **extra
    )
    torch.manual_seed(7)
    model = model_class(config).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
        if not config.tie_word_embeddings:
            model.lm_head.weight.copy_(text.lm_head.weight)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(text_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out_dir / f.name)
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0, do_sample=False)
    model.save_pretrained(out_dir)
    return out_dir


def other_layout(saved: Path, out_dir: Path) -> Path:
    """A copy of multimodal checkpoint `saved` with its tensors named in the other of the two
    layouts published checkpoints use: transformers 5's ("model.language_model.*",
    "lm_head.*", "model.<tower>.*", what it writes for Gemma 4 and Qwen3.5) <-> the older
    one ("language_model.model.*", "language_model.lm_head.*", "<tower>.*", what published
    Gemma 3 checkpoints hold and transformers still writes for Gemma 3). `mtp.*` stays."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(shutil.copytree(saved, out_dir))
    (file,) = out_dir.glob("*.safetensors")
    renamed = {_other_name(name): tensor for name, tensor in load_file(file).items()}
    save_file(renamed, file, metadata={"format": "pt"})
    return out_dir


def _other_name(name: str) -> str:
    swaps = (
        ("model.language_model.", "language_model.model."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "language_model.lm_head."),
        ("mtp.", "mtp."),
        ("model.", ""),
    )
    for old, new in swaps:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return "model." + name  # an older layout's tower


# The text_config of published multimodal checkpoints (their config.json, as public copies
# quote it; the towers' configs left at transformers' defaults: nothing of them is read)
_GEMMA4_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}
# what the published Qwen3.5 text configs share (the sizes differ)
_QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text",
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    vocab_size=248320,
)
PUBLISHED = {
    "google/gemma-3-27b-it": (
        "Gemma3ForConditionalGeneration",
        dict(
            model_type="gemma3_text",
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            query_pre_attn_scalar=168,
            sliding_window=1024,
            sliding_window_pattern=6,
            rope_scaling={"factor": 8.0, "rope_type": "linear"},
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            vocab_size=262208,
            max_position_embeddings=131072,
        ),
    ),
    "google/gemma-4-31B-it": (
        "Gemma4ForConditionalGeneration",
        dict(
            model_type="gemma4_text",
            attention_k_eq_v=True,
            enable_moe_block=False,
            final_logit_softcapping=30.0,
            global_head_dim=512,
            head_dim=256,
            hidden_size=5376,
            hidden_size_per_layer_input=0,
            intermediate_size=21504,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
            max_position_embeddings=262144,
            num_attention_heads=32,
            num_global_key_value_heads=4,
            num_hidden_layers=60,
            num_key_value_heads=16,
            num_kv_shared_layers=0,
            rope_parameters=_GEMMA4_ROPE,
            sliding_window=1024,
            tie_word_embeddings=True,
            use_bidirectional_attention="vision",
            use_double_wide_mlp=False,
            vocab_size=262144,
        ),
    ),
    "google/gemma-4-E2B-it": (
        "Gemma4ForConditionalGeneration",
        dict(
            model_type="gemma4_text",
            attention_k_eq_v=False,
            enable_moe_block=False,
            final_logit_softcapping=30.0,
            global_head_dim=512,
            head_dim=256,
            hidden_size=1536,
            hidden_size_per_layer_input=256,
            intermediate_size=6144,
            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
            max_position_embeddings=131072,
            num_attention_heads=8,
            num_hidden_layers=35,
            num_key_value_heads=1,
            num_kv_shared_layers=20,
            rope_parameters=_GEMMA4_ROPE,
            sliding_window=512,
            tie_word_embeddings=True,
            use_double_wide_mlp=True,
            vocab_size=262144,
            vocab_size_per_layer_input=262144,
        ),
    ),
    "Qwen/Qwen3.5-27B": (
        "Qwen3_5ForConditionalGeneration",
        dict(
            **_QWEN3_5_TEXT,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_value_heads=48,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen/Qwen3.5-0.8B": (
        "Qwen3_5ForConditionalGeneration",
        dict(
            **_QWEN3_5_TEXT,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            tie_word_embeddings=True,
        ),
    ),
}


def published_config(repo: str):
    """transformers' config of published multimodal checkpoint `repo` (PUBLISHED), as
    config.json would load it (its architecture named, the top level's tie_word_embeddings
    the text config's)."""
    import transformers

    architecture, text = PUBLISHED[repo]
    if text.get("layer_types") and len(text["layer_types"]) < text["num_hidden_layers"]:  # one period of the pattern
        text = {**text, "layer_types": text["layer_types"] * (text["num_hidden_layers"] // len(text["layer_types"]))}
    config_class = getattr(transformers, architecture).config_class
    raw = config_class(text_config=text, tie_word_embeddings=text.get("tie_word_embeddings", True)).to_dict()
    return config_class.from_dict({**raw, "architectures": [architecture]})
