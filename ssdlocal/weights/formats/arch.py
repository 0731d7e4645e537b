"""One description per model architecture the torch backend runs: llama, qwen2, qwen3.

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
from dataclasses import dataclass, field
from functools import cached_property

from ssdlocal.core.errors import ModelLoadError, UnsupportedArchitectureError

# Our names: the modules of model.Transformer, outside the layers and inside layer i
# ("layers.{i}." + one of BLOCK_MODULES). A tensor is a module name + "." + a leaf
# (weight, bias; codes, scales, zeros in quantized checkpoints), the leaf the same everywhere.
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
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_SPLITS = ("column", "row", "replicated")


@dataclass(frozen=True)
class TensorNames:
    """How one file format names our modules.

    layer: the prefix of layer i's modules, "{i}" standing for i ("model.layers.{i}.").
    outside: our module -> the file's, for the modules outside the layers (all of them).
    block: our module -> the file's, inside a layer (one missing here keeps our name).
    ignored: endings of tensor names that files may hold and nothing loads.
    """

    layer: str
    outside: Mapping[str, str]
    block: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    def module(self, ours: str) -> str:
        """The file's name for our module `ours` ("layers.3.mlp.up_proj", "lm_head")."""
        inside = _OUR_LAYER.fullmatch(ours)
        if inside is None:
            return self.outside[ours]
        i, part = inside.groups()
        return self.layer.format(i=i) + self.block.get(part, part)

    def theirs(self, ours: str) -> str:
        """The file's name for our tensor `ours` ("layers.3.mlp.up_proj.weight")."""
        module, _, leaf = ours.rpartition(".")
        return f"{self.module(module)}.{leaf}"

    def ours(self, theirs: str) -> str | None:
        """Our name for the file's tensor `theirs`; None for an ignored one; KeyError for
        a name that has no place in our model."""
        if theirs.endswith(self.ignored):
            return None
        module, _, leaf = theirs.rpartition(".")
        if module in self._outside_of:
            return f"{self._outside_of[module]}.{leaf}"
        inside = self._layer.fullmatch(module)
        if inside is None or inside.group(2) not in self._block_of:
            raise KeyError(theirs)
        return f"layers.{inside.group(1)}.{self._block_of[inside.group(2)]}.{leaf}"

    @cached_property
    def _outside_of(self) -> dict[str, str]:
        return {theirs: ours for ours, theirs in self.outside.items()}

    @cached_property
    def _block_of(self) -> dict[str, str]:
        return {self.block.get(part, part): part for part in BLOCK_MODULES}

    @cached_property
    def _layer(self) -> re.Pattern:
        head, _, tail = self.layer.partition("{i}")
        return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + "(.+)")


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
    linears: our module inside a layer (or outside, "lm_head") -> its Linear.
    pair_family: the `family` of its pairs in models/pairs (None: the model_type).
    experts: our modules inside a layer that hold routed experts stacked [E, ...] (a token
    reads `used` of them: weights/size.py); expert_keys: config.json's names for (routed
    experts, experts used per token).
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
    linears: Mapping[str, Linear] = field(default_factory=lambda: dict(LLAMA_LINEARS))
    pair_family: str | None = None
    experts: frozenset[str] = frozenset()
    expert_keys: tuple[str, str] = ("num_experts", "num_experts_per_tok")

    def __post_init__(self) -> None:
        for module, linear in self.linears.items():
            if module not in (*BLOCK_MODULES, "lm_head") or linear.split not in _SPLITS:
                raise ValueError(f"{self.name}: linear {module!r} split {linear.split!r} is not one of ours")
        if self.linears.get("lm_head", Linear()).split != "replicated":
            raise ValueError(f"{self.name}: tensor parallelism keeps lm_head whole on every rank")

    def linear(self, module: str) -> Linear | None:
        """Our module `module`'s Linear ("layers.3.mlp.up_proj", "lm_head"); None if it is none."""
        inside = _OUR_LAYER.fullmatch(module)
        return self.linears.get(inside.group(2) if inside else module)

    def is_expert(self, module: str) -> bool:
        """Whether our module `module` ("layers.3.mlp.experts.down_proj") holds routed experts."""
        inside = _OUR_LAYER.fullmatch(module)
        return inside is not None and inside.group(2) in self.experts

    def expert_counts(self, config: Mapping[str, object]) -> tuple[object, object]:
        """(routed experts, experts used per token) as config.json `config` states them
        (None for a model without experts)."""
        if not self.experts:
            return None, None
        routed, used = self.expert_keys
        return config.get(routed), config.get(used)

    def quantized(self, module: str) -> bool:
        """Whether --quantization int8/int4 stores our module `module` as codes."""
        linear = self.linear(module)
        return linear is not None and linear.quantized

    def split_dim(self, tensor: str) -> int | None:
        """The dimension of our tensor `tensor` that tensor parallelism divides over the
        ranks: 0 (output features), 1 (input features) or None (every rank has it whole)."""
        module, _, leaf = tensor.rpartition(".")
        split = getattr(self.linear(module), "split", "replicated")
        if split == "column":
            return 0
        return 1 if split == "row" and leaf != "bias" else None  # a row split's bias: whole

    def from_checkpoint(self, name: str, tied: bool = False) -> str | None:
        """Our name for checkpoint tensor `name`; None for one nothing loads (ignored
        ones, and a stored lm_head when the embeddings are tied). A name with no place in
        our model comes back unchanged, for the loaders to report as unexpected."""
        try:
            ours = self.checkpoint.ours(name)
        except KeyError:
            return name
        return None if tied and ours == "lm_head.weight" else ours

    def to_checkpoint(self, ours: str) -> str:
        return self.checkpoint.theirs(ours)

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


# --------------------------------------------------------------------------- the table

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

_TABLE: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add `arch` to the table. Its name, `architectures` entries and GGUF name must be
    new; a model_type may repeat (it only names checkpoints without `architectures`)."""
    for other in _TABLE.values():
        clash = {other.name} & {arch.name} | set(other.hf_architectures) & set(arch.hf_architectures)
        if arch.gguf_architecture and arch.gguf_architecture == other.gguf_architecture:
            clash.add(arch.gguf_architecture)
        if clash:
            raise ValueError(f"architecture {arch.name!r} claims {sorted(clash)}, which {other.name!r} has")
    _TABLE[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    _TABLE.pop(name, None)


for _arch in (LLAMA, QWEN2, QWEN3):
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
    it lists none; None when no description claims it."""
    names = list(hf_architectures or [])
    found = next((a for n in names for a in _TABLE.values() if n in a.hf_architectures), None)
    if found is None and not names:
        found = next((a for a in _TABLE.values() if a.model_type == model_type), None)
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
    names = ", ".join(n for a in _TABLE.values() for n in a.hf_architectures)
    return UnsupportedArchitectureError(
        f"unsupported model: {what}",
        hint=f"ssdlocal's torch backend supports {names}; "
        "GGUF files of other architectures may work with the llama.cpp backend",
    )
