"""Our torch models: one module per family over shared blocks (layers.py, moe.py) and one
causal-LM shell (base.py). `FAMILIES` maps a family's name (an architecture's `family`,
weights/formats/archs.py) to its args, which read a transformers config, and its model.

A new family is its module here and its row in FAMILIES, plus its architecture's entry in
weights/formats/archs.py (names, tensor-parallel splits, quantized linears).
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdlocal.backends.torch.models.base import CausalLM, ModelArgs, causal_mask
from ssdlocal.backends.torch.models.fields import text_config
from ssdlocal.backends.torch.models.gemma3 import Gemma3, Gemma3Args
from ssdlocal.backends.torch.models.gemma4 import Gemma4, Gemma4Args
from ssdlocal.backends.torch.models.gpt_oss import GptOss, GptOssArgs
from ssdlocal.backends.torch.models.llama import Llama, LlamaArgs
from ssdlocal.backends.torch.models.qwen3_5 import Qwen3_5, Qwen3_5Args, Qwen3_5Moe
from ssdlocal.backends.torch.models.qwen3_moe import Qwen3Moe, Qwen3MoeArgs
from ssdlocal.weights.formats.archs import architecture, for_hf_config


@dataclass(frozen=True)
class Family:
    """How one family reads its config (`args.from_hf_config(cfg, described)`) and what it builds."""

    args: type[ModelArgs]
    model: type[CausalLM]


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaArgs, Llama),
    "qwen3_moe": Family(Qwen3MoeArgs, Qwen3Moe),
    "qwen3_5": Family(Qwen3_5Args, Qwen3_5),
    "qwen3_5_moe": Family(Qwen3_5Args, Qwen3_5Moe),
    "gemma3": Family(Gemma3Args, Gemma3),
    "gemma4": Family(Gemma4Args, Gemma4),
    "gpt_oss": Family(GptOssArgs, GptOss),
}


def args_from_config(cfg) -> ModelArgs:
    """The args of a transformers config (a multimodal checkpoint's: of its text model,
    fields.text_config): its architecture's family reads the fields it implements and
    refuses, by name, one it does not (UnsupportedArchitectureError)."""
    described = for_hf_config(cfg)
    return FAMILIES[described.family].args.from_hf_config(text_config(cfg, described), described)  # type: ignore[attr-defined]


def build(args: ModelArgs) -> CausalLM:
    """The model of `args` (on the current default device: meta while loading)."""
    return FAMILIES[architecture(args.arch).family].model(args)


__all__ = ["FAMILIES", "CausalLM", "Family", "ModelArgs", "args_from_config", "build", "causal_mask"]
