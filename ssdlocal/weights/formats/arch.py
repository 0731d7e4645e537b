"""How a model architecture is described: what tells it from the others, how its files name
each tensor, and how tensor parallelism and quantization treat each linear. The table of
architectures the torch backend runs is weights/formats/archs.py.

Everything that differs between them lives here and only here: how a checkpoint says
which it is (config.json `architectures` / `model_type`, GGUF `general.architecture`), how
its files name each tensor (Hugging Face safetensors, GGUF), biases and norms, how
llama.cpp orders q/k rows, and per linear its tensor-parallel split and whether it is
quantized. It lives with the file formats because most of it is about files (the model
files' names for everything); the torch backend's model, loaders, quantizer and tensor
parallelism read the rest. A llama-family architecture whose files use other names is
one more entry in the table at the end, and no other module writes a file's tensor name
(tests/test_arch_table.py). Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.weights.formats.packing import Packed

# Our names: the modules of the torch backend's models (backends/torch/models), outside the
# layers and inside layer i ("layers.{i}." + one of an architecture's `modules`). A tensor is
# a module name + "." + a leaf (weight, bias; codes, scales, zeros in quantized checkpoints),
# the leaf the same everywhere. In a module name "{e}" stands for an expert's index (a
# checkpoint storing experts one by one; the loaders stack them into the module without it).
GLOBAL_MODULES = ("embed_tokens", "norm", "lm_head")
BLOCK_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MOE_MODULES = (
    "mlp.gate",  # the router
    *(f"mlp.experts.{{e}}.{p}" for p in EXPERT_PROJECTIONS),  # one expert each (checkpoints)
    *(f"mlp.experts.{p}" for p in EXPERT_PROJECTIONS),  # stacked [E, out, in] (GGUF, ours)
)
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def expert_pattern(module: str) -> str:
    """`module` with an expert's index written as "{e}" ("mlp.experts.3.up_proj" ->
    "mlp.experts.{e}.up_proj"); other names as they are."""
    return _EXPERT.sub(".experts.{e}.", module)


_SPLITS = ("column", "row", "replicated")


@dataclass(frozen=True)
class TensorNames:
    """How one file format names our modules.

    layer: the prefix of layer i's modules, "{i}" standing for i ("model.layers.{i}.").
    outside: our module -> the file's, for the modules outside the layers (all of them).
    block: our module -> the file's, inside a layer (one missing here keeps our name).
    ignored: endings of tensor names that files may hold and nothing loads.
    skipped: beginnings of such names (Qwen3.5's multi-token-prediction layer, "mtp.": no
    drafter reads it yet).
    tensors: tensors that sit in a layer itself, in no module (Gemma 4's "layer_scalar"):
    the same name after the layer's prefix in ours and the file's.
    packed: tensors of a layer stored in another layout than ours (gpt-oss's fused experts),
    by their name after the layer's prefix (the same in ours and the file's) -> Packed.
    renamed: tensors of a layer whose whole name differs, not only their module's: ours
    after the layer's prefix -> the file's (gpt-oss's "self_attn.sinks", llama.cpp's
    "attn_sinks.weight").
    """

    layer: str
    outside: Mapping[str, str]
    block: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    modules: tuple[str, ...] = BLOCK_MODULES  # our modules inside a layer that these files name
    tensors: tuple[str, ...] = ()
    packed: Mapping[str, Packed] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def extended(self, modules: tuple[str, ...], block: Mapping[str, str] | None = None, **changes) -> TensorNames:
        """These names for layers of `modules`, `block`'s names on top of this block's (any
        other field as `changes` give it)."""
        return replace(self, modules=modules, block={**self.block, **(block or {})}, **changes)

    def module(self, ours: str) -> str:
        """The file's name for our module `ours` ("layers.3.mlp.up_proj", "lm_head")."""
        inside = _OUR_LAYER.fullmatch(ours)
        if inside is None:
            return self.outside[ours]
        i, part = inside.groups()
        pattern = expert_pattern(part)
        theirs = self.block.get(pattern, pattern)
        if "{e}" in pattern:  # the same expert's index in their name
            theirs = theirs.replace("{e}", _EXPERT.search("." + part).group(0).split(".")[2])
        return self.layer.format(i=i) + theirs

    def theirs(self, ours: str) -> str:
        """The file's name for our tensor `ours` ("layers.3.mlp.up_proj.weight")."""
        inside = _OUR_LAYER.fullmatch(ours)
        if inside is not None and inside.group(2) in self.tensors:
            return self.layer.format(i=inside.group(1)) + inside.group(2)
        if inside is not None and inside.group(2) in self.renamed:
            return self.layer.format(i=inside.group(1)) + self.renamed[inside.group(2)]
        module, _, leaf = ours.rpartition(".")
        return f"{self.module(module)}.{leaf}"

    def ours(self, theirs: str) -> str | None:
        """Our name for the file's tensor `theirs`; None for an ignored one; KeyError for
        a name that has no place in our model."""
        if theirs.endswith(self.ignored) or theirs.startswith(self.skipped):
            return None
        whole = self._layer.fullmatch(theirs)
        if whole is not None and (whole.group(2) in self.tensors or whole.group(2) in self.packed):
            return f"layers.{whole.group(1)}.{whole.group(2)}"
        if whole is not None and whole.group(2) in self._renamed_of:
            return f"layers.{whole.group(1)}.{self._renamed_of[whole.group(2)]}"
        module, _, leaf = theirs.rpartition(".")
        if module in self._outside_of:
            return f"{self._outside_of[module]}.{leaf}"
        inside = self._layer.fullmatch(module)
        if inside is None:
            raise KeyError(theirs)
        part = inside.group(2)
        ours = self._block_of.get(expert_pattern(part))
        if ours is None:
            raise KeyError(theirs)
        if "{e}" in ours:  # the expert's index carries over
            ours = ours.replace("{e}", _EXPERT.search("." + part).group(0).split(".")[2])
        return f"layers.{inside.group(1)}.{ours}.{leaf}"

    @cached_property
    def _outside_of(self) -> dict[str, str]:
        return {theirs: ours for ours, theirs in self.outside.items()}

    @cached_property
    def _renamed_of(self) -> dict[str, str]:
        return {theirs: ours for ours, theirs in self.renamed.items()}

    @cached_property
    def _block_of(self) -> dict[str, str]:
        return {self.block.get(part, part): part for part in self.modules}

    @cached_property
    def _layer(self) -> re.Pattern:
        head, _, tail = self.layer.partition("{i}")
        return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + "(.+)")


# Where a multimodal checkpoint keeps the text model's tensors, as the text-only checkpoint
# names them: transformers 5 writes "model.language_model." (lm_head at the top); published
# Gemma 3 checkpoints (and transformers 4) wrote "language_model.model." and
# "language_model.lm_head." (transformers' conversion mapping reads both).
LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


@dataclass(frozen=True)
class Multimodal:
    """The multimodal checkpoints (images or audio, and text: transformers'
    *ForConditionalGeneration) that hold an architecture's text model, which is all the
    torch backend runs of them.

    architectures / model_type: what their config.json names (the text model's config is
    its `text_config`; `tie_word_embeddings` stays the top level's, as transformers ties the
    whole model's head). towers: beginnings of the names of the image and audio encoders and
    their projectors (after an optional "model."): never read, never counted.
    media_only: text_config fields whose value acts on image or audio tokens only (Gemma 4's
    `use_bidirectional_attention: "vision"`), which a text-only run never holds: read as unset.
    unread: text_config fields the multimodal model ignores where the text-only one applies
    them (transformers' Gemma3ForConditionalGeneration never soft-caps its logits): refused
    by name when set, as two references disagree (published checkpoints leave them unset).
    """

    architectures: tuple[str, ...]
    model_type: str
    towers: tuple[str, ...]
    media_only: Mapping[str, object] = field(default_factory=dict)
    unread: tuple[str, ...] = ()

    def claims(self, architectures: Iterable[str], model_type: object) -> bool:
        """Whether a config.json naming `architectures` (or, naming none, `model_type`) is one of these."""
        names = list(architectures)
        return bool(set(names) & set(self.architectures)) if names else model_type == self.model_type

    def text_name(self, name: str) -> str | None:
        """The text-only checkpoint's name for tensor `name` of either layout (unchanged when
        it already is one, or has no place in the text model); None for a tower's."""
        for theirs, ours in LANGUAGE_MODEL_PREFIXES:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
        return None if name.removeprefix("model.").startswith(self.towers) else name


@dataclass(frozen=True)
class Linear:
    """One linear layer. split: how tensor parallelism divides it over the ranks:
    "column" (output features: weight rows and bias; whole heads for q/k/v), "row" (input
    features: weight columns; partial outputs summed over the ranks, the bias added once),
    or "replicated". quantized: --quantization int8/int4 turns its weight into codes."""

    split: str = "replicated"
    quantized: bool = True


# Hugging Face checkpoints of the llama family, and llama.cpp's GGUF names for them.
HF_NAMES = TensorNames(
    layer="model.layers.{i}.",
    outside={"embed_tokens": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
    ignored=("rotary_emb.inv_freq",),  # some old checkpoints store it; it is recomputed
)
GGUF_NAMES = TensorNames(
    layer="blk.{i}.",
    outside={"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"},
    block={
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
    ignored=("rope_freqs.weight",),  # llama3 RoPE factors: recomputed from the config
)
LLAMA_LINEARS = {
    "self_attn.q_proj": Linear("column"),
    "self_attn.k_proj": Linear("column"),
    "self_attn.v_proj": Linear("column"),
    "self_attn.o_proj": Linear("row"),
    "mlp.gate_proj": Linear("column"),
    "mlp.up_proj": Linear("column"),
    "mlp.down_proj": Linear("row"),
    "lm_head": Linear("replicated"),  # every rank computes the full logits
}


@dataclass(frozen=True)
class Architecture:
    """Everything that tells one architecture of the llama family from another.

    name: ours (ModelArgs.arch, log lines). hf_architectures: config.json `architectures`
    entries it claims (the first is written into checkpoints converted from GGUF).
    model_type: config.json `model_type`, used when `architectures` is absent.
    config_type: a transformers model_type whose config class reads this config.json, for
    a model_type transformers does not know (None: transformers knows it).
    gguf_architecture: GGUF `general.architecture` (None: no GGUF files).
    checkpoint / gguf: how its safetensors / GGUF files name our tensors.
    qkv_bias / o_bias: whether q/k/v and o_proj have biases; None: as config.json's
    `attention_bias` says. qk_norm: per-head RMSNorm on q and k before RoPE.
    gguf_qk_interleaved: llama.cpp stores each head's q/k rows as (pairs, 2), not (2, half).
    gguf_norm_shift: what llama.cpp added to every norm weight (Gemma's 1 of (1 + weight));
    our models take it off again.
    linears: our module inside a layer (or outside, "lm_head") -> its Linear (expert modules
    written with "{e}", or stacked).
    pair_family: the `family` of its pairs in models/pairs (None: the model_type).
    family: the torch backend's model family that computes it (backends/torch/models).
    experts: our modules inside a layer that hold routed experts stacked [E, ...] (a token
    reads `used` of them: weights/size.py); expert_keys: config.json's names for (routed
    experts, experts used per token).
    per_head: our tensors inside a layer holding one value per query head (gpt-oss's
    `self_attn.sinks`): tensor parallelism splits them with the heads.
    gguf_config: GGUF metadata keys (after "{gguf_architecture}.") -> the config.json field
    each states, for the fields transformers' GGUF reader leaves out or reads otherwise
    (weights/formats/gguf_tensors.py applies them to a GGUF's config).
    multimodal: the multimodal checkpoints holding this text model (None: there are none);
    their tensor names are read beside the text-only ones (the two never collide).
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_type: str
    config_type: str | None = None
    gguf_architecture: str | None = None
    checkpoint: TensorNames = HF_NAMES
    gguf: TensorNames = GGUF_NAMES
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    gguf_qk_interleaved: bool = False
    gguf_norm_shift: float = 0.0
    linears: Mapping[str, Linear] = field(default_factory=lambda: dict(LLAMA_LINEARS))
    pair_family: str | None = None
    experts: frozenset[str] = frozenset()
    expert_keys: tuple[tuple[str, ...], str] = (("num_experts", "num_local_experts"), "num_experts_per_tok")
    family: str = "llama"
    per_head: tuple[str, ...] = ()
    gguf_config: Mapping[str, str] = field(default_factory=dict)
    multimodal: Multimodal | None = None

    def __post_init__(self) -> None:
        for module, linear in self.linears.items():
            if module not in (*self.checkpoint.modules, "lm_head") or linear.split not in _SPLITS:
                raise ValueError(f"{self.name}: linear {module!r} split {linear.split!r} is not one of ours")
        if self.linears.get("lm_head", Linear()).split != "replicated":
            raise ValueError(f"{self.name}: tensor parallelism keeps lm_head whole on every rank")

    def linear(self, module: str) -> Linear | None:
        """Our module `module`'s Linear ("layers.3.mlp.up_proj", "lm_head"); None if it is none."""
        inside = _OUR_LAYER.fullmatch(module)
        return self.linears.get(expert_pattern(inside.group(2)) if inside else module)

    def is_expert(self, module: str) -> bool:
        """Whether our module `module` ("layers.3.mlp.experts.down_proj", or one expert's
        "layers.3.mlp.experts.7.down_proj") holds routed experts' weights."""
        inside = _OUR_LAYER.fullmatch(module)
        return inside is not None and expert_pattern(inside.group(2)) in self.experts

    def expert_counts(self, config: Mapping[str, object]) -> tuple[object, object]:
        """(routed experts, experts used per token) as config.json `config` states them
        (None for a model without experts)."""
        if not self.experts:
            return None, None
        routed, used = self.expert_keys
        return next((config[k] for k in routed if config.get(k)), None), config.get(used)

    def quantized(self, module: str) -> bool:
        """Whether --quantization int8/int4 stores our module `module` as codes."""
        linear = self.linear(module)
        return linear is not None and linear.quantized

    def split_dim(self, tensor: str) -> int | None:
        """The dimension of our tensor `tensor` that tensor parallelism divides over the
        ranks: 0 (output features), 1 (input features) or None (every rank has it whole)."""
        inside = _OUR_LAYER.fullmatch(tensor)
        if inside is not None and inside.group(2) in self.per_head:
            return 0
        module, _, leaf = tensor.rpartition(".")
        split = getattr(self.linear(module), "split", "replicated")
        stacked = 1 if self.is_expert(module) and "{e}" not in expert_pattern(module) else 0  # [E, out, in]
        if split == "column":
            return stacked
        return 1 + stacked if split == "row" and leaf != "bias" else None  # a row split's bias: whole

    def from_checkpoint(self, name: str, tied: bool = False) -> str | None:
        """Our name for checkpoint tensor `name` (a multimodal checkpoint's text tensors
        included); None for one nothing loads (ignored ones, image and audio towers, and a
        stored lm_head when the embeddings are tied). A name with no place in
        our model comes back unchanged, for the loaders to report as unexpected."""
        text = name if self.multimodal is None else self.multimodal.text_name(name)
        if text is None:  # an image or audio tower's
            return None
        try:
            ours = self.checkpoint.ours(text)
        except KeyError:
            return name
        return None if tied and ours == "lm_head.weight" else ours

    def to_checkpoint(self, ours: str) -> str:
        return self.checkpoint.theirs(ours)

    def packed(self, ours: str) -> tuple[Packed, tuple[str, ...]] | None:
        """For our name of a tensor its checkpoints store packed ("layers.3." + its name in
        the layer, from `from_checkpoint`): its Packed and the names of our tensors it
        holds; None for any other tensor."""
        inside = _OUR_LAYER.fullmatch(ours)
        found = None if inside is None else self.checkpoint.packed.get(inside.group(2))
        return None if found is None else (found, tuple(f"layers.{inside.group(1)}.{t}" for t in found.into))

    def checkpoint_shapes(self, name: str, shape) -> dict[str, tuple[int, ...]]:
        """Our tensors in checkpoint tensor `name` of shape `shape`, with their shapes: the
        tensor itself under our name (a name with no place in our model unchanged), or what a
        packed one holds; none for an ignored tensor or MXFP4 scales."""
        ours = self.from_checkpoint(name)
        if ours is None:
            return {}
        packed = self.packed(ours)
        if packed is None:
            return {ours: tuple(shape)}
        return dict(zip(packed[1], self.packed_shapes(name, packed[0], tuple(shape))))

    def packed_shapes(self, name: str, packed: Packed, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """`packed.shapes(shape)` for checkpoint tensor `name`; a shape that cannot hold
        our tensors is a ModelLoadError naming it."""
        try:
            return packed.shapes(shape)
        except ValueError as exc:
            raise ModelLoadError(
                f"checkpoint tensor {name} {exc}: it cannot hold the {self.name} model's {', '.join(packed.into)}",
                hint="the weights may be from another model or damaged; download the model again",
            ) from None

    def from_gguf(self, name: str) -> str | None:
        """Our name for GGUF tensor `name`; None for one nothing loads."""
        try:
            return self.gguf.ours(name)
        except KeyError:
            raise ModelLoadError(
                f"GGUF tensor {name!r} has no place in a {self.name} model",
                "the file may hold another architecture; try the llama.cpp backend",
            ) from None

    def biases(self, attention_bias: bool) -> tuple[bool, bool]:
        """(q/k/v have biases, o_proj has one) for a config whose `attention_bias` is given."""
        qkv = attention_bias if self.qkv_bias is None else self.qkv_bias
        return qkv, attention_bias if self.o_bias is None else self.o_bias
