"""The architectures the torch backend runs, one description each (weights/formats/arch.py
says what a description holds), and how a checkpoint or a GGUF file finds its own.

A new architecture is one more entry here and, when it computes differently from the
families the torch backend has, its family module (backends/torch/models). Names must not
clash (`register` checks). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from ssdlocal.core.errors import UnsupportedArchitectureError
from ssdlocal.weights.formats.arch import (
    BLOCK_MODULES,
    EXPERT_PROJECTIONS,
    GGUF_NAMES,
    HF_NAMES,
    LLAMA_LINEARS,
    MOE_MODULES,
    Architecture,
    Linear,
    Multimodal,
    Packed,
    TensorNames,
)

LLAMA = Architecture(
    "llama", ("LlamaForCausalLM",), "llama", gguf_architecture="llama", gguf_qk_interleaved=True, pair_family="llama3"
)
QWEN2 = Architecture(
    "qwen2",
    ("Qwen2ForCausalLM",),
    "qwen2",
    gguf_architecture="qwen2",
    qkv_bias=True,
    o_bias=False,
    pair_family="qwen2.5",
)
QWEN3 = Architecture("qwen3", ("Qwen3ForCausalLM",), "qwen3", gguf_architecture="qwen3", qk_norm=True)

# Qwen3-MoE: Qwen3's attention, a router and experts in the sparse layers (Hugging Face
# checkpoints name each expert, or store them fused as transformers holds them: gate_up_proj
# [E, 2I, H], gate's rows then up's, and down_proj [E, H, I]; GGUF files stack them); experts
# split by their width under tensor parallelism, the router whole on every rank.
_GATE_UP = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight")
_DOWN = ("mlp.experts.down_proj.weight",)
_FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": Packed(_GATE_UP, layout="halves", dims=3),
    "mlp.experts.down_proj": Packed(_DOWN, dims=3),
}
_MOE_MODULES = (*BLOCK_MODULES, *MOE_MODULES)
# the routed experts (every MoE family's): their linears split as a dense MLP's (down_proj by
# rows, the others by columns), named one by one or stacked; the router is none of them
_EXPERT_LINEARS = {
    **{f"mlp.experts.{{e}}.{p}": Linear("row" if p == "down_proj" else "column") for p in EXPERT_PROJECTIONS},
    **{f"mlp.experts.{p}": Linear("row" if p == "down_proj" else "column") for p in EXPERT_PROJECTIONS},
}
_ROUTED_EXPERTS = frozenset(m for m in MOE_MODULES if m != "mlp.gate")
_GGUF_EXPERTS = {  # llama.cpp's names of the stacked experts
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
QWEN3_MOE = Architecture(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    "qwen3_moe",
    gguf_architecture="qwen3moe",
    checkpoint=HF_NAMES.extended(_MOE_MODULES, packed=_FUSED_EXPERTS),
    gguf=GGUF_NAMES.extended(_MOE_MODULES, {"mlp.gate": "ffn_gate_inp", **_GGUF_EXPERTS}),
    qk_norm=True,
    linears={
        **LLAMA_LINEARS,
        "mlp.gate": Linear("replicated", quantized=False),  # the router: small, and routing must agree
        **_EXPERT_LINEARS,
    },
    pair_family="qwen3",
    experts=_ROUTED_EXPERTS,
    family="qwen3_moe",
    # transformers' GGUF reader takes the expert counts but not the experts' width
    gguf_config={
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
    },
)

# Qwen3.5 (dense, MoE): Gated DeltaNet linear-attention layers (in_proj_*, a depthwise
# conv1d, A_log and dt_bias leaves of `linear_attn` itself, a gated norm) between gated
# full-attention ones (q_proj gives each head its query and gate); the MoE adds a shared
# expert and its gate. The linear layers stay whole on every tensor-parallel rank
# (replicated); their small decay projections (in_proj_a/b) stay unquantized.
_LINEAR_MODULES = (
    "linear_attn",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.conv1d",
    "linear_attn.norm",
    "linear_attn.out_proj",
)
_LINEAR_LINEARS = {
    "linear_attn.in_proj_qkv": Linear("replicated"),
    "linear_attn.in_proj_z": Linear("replicated"),
    "linear_attn.in_proj_b": Linear("replicated", quantized=False),
    "linear_attn.in_proj_a": Linear("replicated", quantized=False),
    "linear_attn.out_proj": Linear("replicated"),
}
_SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
_QWEN3_5_MODULES = (*BLOCK_MODULES, *_LINEAR_MODULES)
_QWEN3_5_MOE_MODULES = (*_QWEN3_5_MODULES, *MOE_MODULES, *_SHARED_EXPERT, "mlp.shared_expert_gate")
QWEN3_5 = Architecture(
    "qwen3_5",
    ("Qwen3_5ForCausalLM",),
    "qwen3_5_text",
    checkpoint=HF_NAMES.extended(_QWEN3_5_MODULES, skipped=("mtp.",)),
    qk_norm=True,
    linears={**LLAMA_LINEARS, **_LINEAR_LINEARS},
    pair_family="qwen3.5",
    family="qwen3_5",
    multimodal=Multimodal(("Qwen3_5ForConditionalGeneration",), "qwen3_5", towers=("visual.",)),
)
QWEN3_5_MOE = Architecture(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM",),
    "qwen3_5_moe_text",
    checkpoint=HF_NAMES.extended(_QWEN3_5_MOE_MODULES, skipped=("mtp.",), packed=_FUSED_EXPERTS),
    qk_norm=True,
    linears={
        **{m: linear for m, linear in LLAMA_LINEARS.items() if not m.startswith("mlp.")},
        **_LINEAR_LINEARS,
        "mlp.gate": Linear("replicated", quantized=False),
        **_EXPERT_LINEARS,
        **{m: Linear("row" if m.endswith("down_proj") else "column") for m in _SHARED_EXPERT},
        "mlp.shared_expert_gate": Linear("replicated", quantized=False),
    },
    experts=_ROUTED_EXPERTS,
    pair_family="qwen3.5",
    family="qwen3_5_moe",
    multimodal=Multimodal(("Qwen3_5MoeForConditionalGeneration",), "qwen3_5_moe", towers=("visual.",)),
)

# Gemma 3: four norms per layer (llama.cpp: attn_norm, post_attention_norm, ffn_norm,
# post_ffw_norm) and q/k norms; tied embeddings. llama.cpp stores Gemma's norm weights
# with the 1 of (1 + weight) added (gguf_norm_shift).
_GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_GEMMA3_MODULES = (*BLOCK_MODULES, *_GEMMA_NORMS)
_GEMMA_GGUF_NORMS = {  # llama.cpp's names of the norms around attention and feed-forward
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA3 = Architecture(
    "gemma3",
    ("Gemma3ForCausalLM",),
    "gemma3_text",
    gguf_architecture="gemma3",
    checkpoint=HF_NAMES.extended(_GEMMA3_MODULES),
    gguf=GGUF_NAMES.extended(_GEMMA3_MODULES, _GEMMA_GGUF_NORMS),
    qk_norm=True,
    gguf_norm_shift=1.0,
    pair_family="gemma3",
    family="gemma3",
    multimodal=Multimodal(
        ("Gemma3ForConditionalGeneration",),
        "gemma3",
        towers=("vision_tower.", "multi_modal_projector."),
        unread=("final_logit_softcapping",),
    ),
)

# Gemma 4: Gemma 3's layer plus the per-layer input branch (gate, projection, norm) and a
# per-layer output scale; the per-layer embedding table and its projection sit outside the
# layers. Layers that share another's KV hold no k/v projections (the model builds none).
_GEMMA4_MODULES = (
    *_GEMMA3_MODULES,
    "per_layer_input_gate",
    "per_layer_projection",
    "post_per_layer_input_norm",
)
_PER_LAYER_EMBEDDINGS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
GEMMA4 = Architecture(
    "gemma4",
    ("Gemma4ForCausalLM",),
    "gemma4_text",
    # GGUF: llama.cpp's names; gguf_config.py reads the dense text model without per-layer
    # inputs (their tensors named here, refused there)
    gguf_architecture="gemma4",
    gguf=TensorNames(
        GGUF_NAMES.layer,
        {
            **GGUF_NAMES.outside,
            "embed_tokens_per_layer": "per_layer_token_embd",
            "per_layer_model_projection": "per_layer_model_proj",
            "per_layer_projection_norm": "per_layer_proj_norm",
        },
        {
            **GGUF_NAMES.block,
            **_GEMMA_GGUF_NORMS,
            "per_layer_input_gate": "inp_gate",
            "per_layer_projection": "proj",
            "post_per_layer_input_norm": "post_norm",
        },
        GGUF_NAMES.ignored,
        modules=_GEMMA4_MODULES,
        renamed={"layer_scalar": "layer_output_scale.weight"},
    ),
    checkpoint=HF_NAMES.extended(
        _GEMMA4_MODULES,
        outside={**HF_NAMES.outside, **{m: f"model.{m}" for m in _PER_LAYER_EMBEDDINGS}},
        tensors=("layer_scalar",),
    ),
    qk_norm=True,
    linears={
        **LLAMA_LINEARS,
        "per_layer_input_gate": Linear("replicated"),  # narrow (hidden -> per-layer width): every rank whole
        "per_layer_projection": Linear("replicated"),
    },
    pair_family="gemma4",
    family="gemma4",
    multimodal=Multimodal(
        ("Gemma4ForConditionalGeneration",),
        "gemma4",
        towers=("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio."),
        media_only={"use_bidirectional_attention": "vision"},  # image tokens see each other; text is causal
    ),
)

# gpt-oss: attention with biases and per-head sinks (`self_attn.sinks`), a router with a bias
# (`mlp.router`) and experts with biases. Checkpoints store the experts as transformers
# holds them, fused and transposed (gate_up_proj [E, H, 2I], gate and up interleaved;
# down_proj [E, I, H]), or as published, MXFP4 (`*_blocks`, `*_scales`, [E, out, ...]): both
# unpacked at load into our stacked gate/up/down (Packed). GGUF files (llama.cpp's
# "gpt-oss") store them as ours, gate and up apart, stacked [E, out, in] (the experts in
# MXFP4 as llama.cpp's converter writes them: de-quantized at load), sinks as
# "attn_sinks.weight", the post-attention norm as "post_attention_norm".
_GPT_OSS_MODULES = (
    *(m for m in BLOCK_MODULES if not m.startswith("mlp.")),
    "self_attn",  # its sinks
    "mlp.router",
    *(m for m in MOE_MODULES if m != "mlp.gate"),
)
GPT_OSS = Architecture(
    "gpt_oss",
    ("GptOssForCausalLM",),
    "gpt_oss",
    checkpoint=TensorNames(
        HF_NAMES.layer,
        HF_NAMES.outside,
        ignored=HF_NAMES.ignored,
        modules=_GPT_OSS_MODULES,
        packed={
            "mlp.experts.gate_up_proj": Packed(_GATE_UP, transposed=True),
            "mlp.experts.gate_up_proj_bias": Packed(("mlp.experts.gate_proj.bias", "mlp.experts.up_proj.bias")),
            "mlp.experts.gate_up_proj_blocks": Packed(_GATE_UP, mxfp4="blocks"),
            "mlp.experts.gate_up_proj_scales": Packed(_GATE_UP, mxfp4="scales"),
            "mlp.experts.down_proj": Packed(_DOWN, transposed=True),
            "mlp.experts.down_proj_bias": Packed(("mlp.experts.down_proj.bias",)),
            "mlp.experts.down_proj_blocks": Packed(_DOWN, mxfp4="blocks"),
            "mlp.experts.down_proj_scales": Packed(_DOWN, mxfp4="scales"),
        },
    ),
    gguf_architecture="gpt-oss",
    gguf=TensorNames(
        GGUF_NAMES.layer,
        GGUF_NAMES.outside,
        {
            **GGUF_NAMES.block,
            "post_attention_layernorm": "post_attention_norm",
            "mlp.router": "ffn_gate_inp",
            **_GGUF_EXPERTS,
        },
        GGUF_NAMES.ignored,
        modules=_GPT_OSS_MODULES,
        renamed={"self_attn.sinks": "attn_sinks.weight"},
    ),
    linears={
        **{m: linear for m, linear in LLAMA_LINEARS.items() if not m.startswith("mlp.")},
        "mlp.router": Linear("replicated", quantized=False),  # small, and routing must agree
        **_EXPERT_LINEARS,
    },
    pair_family="gpt-oss",
    experts=_ROUTED_EXPERTS,
    family="gpt_oss",
    per_head=("self_attn.sinks",),
    # transformers' GGUF reader takes the dense width (llama.cpp reads the experts') and
    # looks for the window under another key
    gguf_config={
        "expert_feed_forward_length": "intermediate_size",
        "attention.sliding_window": "sliding_window",
    },
)

_TABLE: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add `arch` to the table. Its name, `architectures` entries and GGUF name must be
    new; a model_type may repeat (it only names checkpoints without `architectures`)."""
    for other in _TABLE.values():
        clash = {other.name} & {arch.name} | _claimed(other) & _claimed(arch)
        if arch.gguf_architecture and arch.gguf_architecture == other.gguf_architecture:
            clash.add(arch.gguf_architecture)
        if clash:
            raise ValueError(f"architecture {arch.name!r} claims {sorted(clash)}, which {other.name!r} has")
    _TABLE[arch.name] = arch
    return arch


def _claimed(arch: Architecture) -> set[str]:
    """The config.json `architectures` entries `arch` claims (its multimodal ones included)."""
    return {*arch.hf_architectures, *(arch.multimodal.architectures if arch.multimodal else ())}


def unregister(name: str) -> None:
    _TABLE.pop(name, None)


for _arch in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE, GEMMA3, GEMMA4, GPT_OSS):
    register(_arch)


def architectures() -> tuple[Architecture, ...]:
    return tuple(_TABLE.values())


def architecture(name: str) -> Architecture:
    """The description named `name` (ModelArgs.arch)."""
    if name not in _TABLE:
        raise unsupported(f"architecture {name}")
    return _TABLE[name]


def find(hf_architectures: Iterable[str] | None, model_type: str | None) -> Architecture | None:
    """The description a config.json names: by `architectures`, or by `model_type` when
    it lists none (a multimodal checkpoint's: the text model it holds); None when no
    description claims it."""
    names = list(hf_architectures or [])
    found = next((a for n in names for a in _TABLE.values() if n in a.hf_architectures), None)
    if found is None and not names:
        found = next((a for a in _TABLE.values() if a.model_type == model_type), None)
    if found is None:  # a multimodal checkpoint holding one of these text models
        found = next((a for a in _TABLE.values() if a.multimodal and a.multimodal.claims(names, model_type)), None)
    return found


def for_hf_config(cfg) -> Architecture:
    """The description of a transformers config (UnsupportedArchitectureError if none)."""
    names, model_type = getattr(cfg, "architectures", None), getattr(cfg, "model_type", None)
    found = find(names, model_type)
    if found is None:
        raise unsupported(f"architecture {', '.join(names or []) or model_type or 'unknown'}")
    return found


def for_gguf(gguf_architecture: object, file_name: str) -> Architecture:
    """The description of a GGUF file whose `general.architecture` is `gguf_architecture`."""
    found = next((a for a in _TABLE.values() if a.gguf_architecture == gguf_architecture), None)
    if found is None:
        supported = ", ".join(a.gguf_architecture for a in _TABLE.values() if a.gguf_architecture)
        raise UnsupportedArchitectureError(
            f"{file_name} has architecture {str(gguf_architecture)!r}, which ssdlocal does not implement",
            f"supported GGUF architectures: {supported}",
        )
    return found


def unsupported(what: str) -> UnsupportedArchitectureError:
    names = ", ".join(
        n
        for a in _TABLE.values()
        for n in (*a.hf_architectures, *(f"{m} (text)" for m in (a.multimodal.architectures if a.multimodal else ())))
    )
    return UnsupportedArchitectureError(
        f"unsupported model: {what}",
        hint=f"ssdlocal's torch backend supports {names}; "
        "GGUF files of other architectures may work with the llama.cpp backend",
    )


# ------------------------------------------------------------------ pair families
# the sizes (billions) each pair family's small models come in, beyond the registry's own
# (a pull looks for a draft among them: weights/drafts.py)
FAMILY_SIZES = {
    "qwen2.5": (0.5, 1.5, 3.0),
    "qwen3": (0.6, 1.7, 4.0),
    "llama3": (1.0, 3.0),
    "gemma3": (0.27, 1.0),
    "qwen3.5": (0.8, 2.0, 4.0, 9.0),
    "gpt-oss": (20.0,),  # gpt-oss-20b: the draft of gpt-oss-120b
}

# ------------------------------------------------------------------ draft heads
# config.json `architectures` of the draft heads the torch backend reads, by kind
# (backends/torch/heads loads each kind)
HEADS = {
    "eagle3": ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3LlamaForCausalLM2"),
    "gemma4_assistant": ("Gemma4AssistantForCausalLM",),
    "mtp": (),  # a target checkpoint's own mtp.* layer: named by `--draft mtp`, never found by config
    "dflash": ("MuseGlimmerAssistantModel", "DFlashDraftModel", "DFlash2DraftModel"),  # block drafters
}


def head_kind(path) -> str | None:
    """The kind of draft head the directory `path` holds (a key of HEADS), or None."""
    import json
    from pathlib import Path

    try:
        raw = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = raw.get("architectures") or () if isinstance(raw, dict) else ()
    return next((kind for kind, claimed in HEADS.items() if set(claimed) & set(names)), None)


def head_most_drafts(path, kind: str) -> int | None:
    """The most drafts a head of `kind` at `path` gives a round (a DFlash drafter: its
    block_size - 1), or None where it has no such bound."""
    import json
    from pathlib import Path

    if kind != "dflash":
        return None
    try:
        raw = json.loads((Path(path).expanduser() / "config.json").read_text())
        block = (raw.get("dflash_config") or {}).get("block_size", raw.get("block_size", 16))
        return max(int(block) - 1, 1)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
