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
