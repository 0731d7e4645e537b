"""A llama-family architecture ssdlocal does not ship, for the proof that adding one is a
single description (test_arch_table.py): its config.json has a model_type transformers
does not know, its safetensors files name tensors the Meta way ("tok_embeddings",
"layers.{i}.attention.wq", "feed_forward.w1", "output"), and its GGUF files use tensor
names of their own. "mistral" stands in for its GGUF architecture: a name no built-in
description claims and whose metadata transformers can read (config and tokenizer come
from there); llama.cpp interleaves its q/k rows as it does llama's.

Checkpoints are written from a llama checkpoint with the hand-written renames below, not
with the description, so loading them tests the description.

As a script it checks tensor parallelism: `python tests/support/renamed_arch.py RENAMED LLAMA`
prints the greedy tokens of TP=2 and TP=1 runs as JSON. Tensor-parallel ranks are spawned
processes that run this file again as their main module, so the description is
registered in every rank too, as it would be were it in ssdlocal's table.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from ssdlocal.weights.formats.arch import Architecture, TensorNames
from ssdlocal.weights.formats.archs import register

RENAMED = Architecture(
    "renamed-llama",
    ("RenamedLlamaForCausalLM",),
    "renamed_llama",
    config_type="llama",
    gguf_architecture="mistral",
    gguf_qk_interleaved=True,
    checkpoint=TensorNames(
        layer="layers.{i}.",
        outside={"embed_tokens": "tok_embeddings", "norm": "norm", "lm_head": "output"},
        block={
            "input_layernorm": "attention_norm",
            "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attention.wq",
            "self_attn.k_proj": "attention.wk",
            "self_attn.v_proj": "attention.wv",
            "self_attn.o_proj": "attention.wo",
            "mlp.gate_proj": "feed_forward.w1",
            "mlp.up_proj": "feed_forward.w3",
            "mlp.down_proj": "feed_forward.w2",
        },
    ),
    gguf=TensorNames(
        layer="blocks.{i}.",
        outside={"embed_tokens": "embeddings", "norm": "final_norm", "lm_head": "unembed"},
        block={
            "input_layernorm": "norm_attn",
            "post_attention_layernorm": "norm_mlp",
            "self_attn.q_proj": "wq",
            "self_attn.k_proj": "wk",
            "self_attn.v_proj": "wv",
            "self_attn.o_proj": "wo",
            "mlp.gate_proj": "w_gate",
            "mlp.up_proj": "w_up",
            "mlp.down_proj": "w_down",
        },
    ),
)

# Hugging Face llama names -> this architecture's, written out by hand (in this order).
_RENAMES = (
    ("model.embed_tokens", "tok_embeddings"),
    ("model.norm", "norm"),
    ("lm_head", "output"),
    ("model.layers.", "layers."),
    ("post_attention_layernorm", "ffn_norm"),
    ("input_layernorm", "attention_norm"),
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("mlp.down_proj", "feed_forward.w2"),
)
_GGUF_OUTSIDE = {"model.embed_tokens": "embeddings", "model.norm": "final_norm", "lm_head": "unembed"}
_GGUF_BLOCK = {
    "input_layernorm": "norm_attn",
    "post_attention_layernorm": "norm_mlp",
    "self_attn.q_proj": "wq",
    "self_attn.k_proj": "wk",
    "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo",
    "mlp.gate_proj": "w_gate",
    "mlp.up_proj": "w_up",
    "mlp.down_proj": "w_down",
}


def renamed(hf_name: str) -> str:
    for old, new in _RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def gguf_name(hf_module: str) -> str:
    """This architecture's GGUF name for a Hugging Face llama module name."""
    if hf_module in _GGUF_OUTSIDE:
        return _GGUF_OUTSIDE[hf_module]
    i, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_module).groups()
    return f"blocks.{i}.{_GGUF_BLOCK[part]}"


def write_checkpoint(llama_dir: Path, out: Path) -> Path:
    """`llama_dir` (a Hugging Face llama checkpoint) saved as this architecture."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(architectures=["RenamedLlamaForCausalLM"], model_type="renamed_llama")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for file in sorted(llama_dir.glob("*.safetensors")):
        tensors.update({renamed(name): t for name, t in load_file(file).items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def greedy_tokens(path: Path, devices: tuple[str, ...] = (), quantization: str = "none") -> list[list[int]]:
    from ssdlocal.core.config import (
        EngineConfig,
        Mode,
        ModelSpec,
        SamplingParams,
        SpecConfig,
    )
    from ssdlocal.core.events import DoneEvent
    from ssdlocal.engine import Engine

    config = EngineConfig(
        target=ModelSpec(str(path), dtype="float32", quantization=quantization),
        spec=SpecConfig(mode=Mode.AR),
        pin_cpus=False,
        target_devices=devices,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    with Engine(config) as engine:
        done = [e for e in engine.generate(["The quick brown fox", "def foo(x):"], params) if isinstance(e, DoneEvent)]
    return [list(o.token_ids) for o in done[0].outputs]


if __name__ in ("__main__", "__mp_main__"):  # this script, and the ranks it spawns
    register(RENAMED)

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    renamed_dir, llama_dir = Path(sys.argv[1]), Path(sys.argv[2])
    tp2 = ("cpu", "cpu")
    print(
        json.dumps(
            {
                "llama_tp1": greedy_tokens(llama_dir),
                "renamed_tp2": greedy_tokens(renamed_dir, tp2),
                "llama_int8_tp1": greedy_tokens(llama_dir, quantization="int8"),
                "renamed_int8_tp2": greedy_tokens(renamed_dir, tp2, "int8"),
            }
        )
    )
