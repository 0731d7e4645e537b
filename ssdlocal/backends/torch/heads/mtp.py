"""Multi-token prediction (MTP) layers shipped inside a Qwen3.5 checkpoint (`mtp.*`), as vLLM
and SGLang compute them (their qwen3_5_mtp / qwen3_next_mtp): the target's embedding of
token q + 1 and the target's final hidden state after token q (normed, what its lm_head
reads), each RMS-normed (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), concatenated in
that order and projected back to the hidden width (`fc`); one decoder layer built as the
target's full-attention layers (gated attention, q/k norms, partial rotary positions; the
MLP, or the shared-expert MoE of a MoE checkpoint, its experts stored one by one or fused
as the model's layers may store them); the final norm `mtp.norm`; the
target's lm_head. Norms are Qwen3.5's zero-centred ones (scale 1 + weight).

Positions are the target's: the pair (state after token q, token q + 1) sits at position q
and predicts token q + 2, with a one-layer KV cache of its own (heads/runner.py). Drafting
past the first token, the head feeds its own normed output back as the next state (vLLM's
MTP with several speculative tokens: the same layer again). Embeddings and lm_head are the
target's (the checkpoint shares them); the head's own weights load dense in the target's
dtype whatever the target's quantization. Checkpoints with more than one MTP layer are
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ssdlocal.backends.base import FINAL_HIDDEN, HeadInputs
from ssdlocal.backends.torch.attention import AttentionMask
from ssdlocal.backends.torch.logits import fp32_logits
from ssdlocal.backends.torch.models.hybrid import HybridBlock
from ssdlocal.backends.torch.models.layers import MLP, RopeTable
from ssdlocal.backends.torch.models.qwen3_5 import GatedAttention, Qwen3_5Args, SharedExpertMoE, zero_centred
from ssdlocal.core.errors import ModelLoadError
from ssdlocal.backends.torch.heads.shared import check_state

HINT = "use the checkpoint as published (its mtp.* tensors), or another --draft"


@dataclass(frozen=True)
class MtpArgs:
    """The target's args (the MTP layer is one of its full-attention layers) and whether
    that layer's feed-forward is the MoE."""

    target: Qwen3_5Args
    moe: bool

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden states it reads (backends.base.HiddenLayers): the final one."""
        return (FINAL_HIDDEN,)


class MtpHead(nn.Module):
    """fc, its two input norms, one decoder layer (`layers.0`), the final norm; the embedding
    and lm_head are the target's (`embed`, `lm_head`, not in the state dict)."""

    def __init__(self, args: MtpArgs, embed: nn.Module, lm_head: nn.Module, target_vocab: int) -> None:
        super().__init__()
        self.args, self.target_vocab = args, target_vocab
        self.shared = (embed, lm_head)  # a tuple: not registered, not in the state dict
        a = args.target
        h = a.hidden_size

        def norm() -> nn.Module:
            return zero_centred(h, a.rms_norm_eps)

        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        mlp = SharedExpertMoE(a) if args.moe else MLP(h, a.intermediate_size)
        self.layers = nn.ModuleList([HybridBlock(GatedAttention(a), mlp, norm)])
        self.norm = norm()
        self.rope = RopeTable(a.rotary_dim, a.rope_theta, None)

    @property
    def attention(self) -> nn.Module:
        """The attention whose KV cache the runner allocates."""
        return self.layers[0].self_attn

    def cover(self, positions: int, device) -> None:
        """Rotary tables for positions [0, `positions`)."""
        self.rope.cover(positions, device)

    def forward(
        self, ids: Tensor, state: Tensor, positions: Tensor, mask: AttentionMask, fuse: bool = True
    ) -> tuple[Tensor, Tensor]:
        """ids/positions [B, T]; `state` [B, T, hidden]: the target's final hidden state, or the
        head's own output from its last step (the same formula for both: `fuse` is the runner's
        word for which it is) -> (logits [B, T, V] float32, the next state [B, T, hidden])."""
        embed, lm_head = self.shared
        embeds = self.pre_fc_norm_embedding(embed(ids).to(state.dtype))  # [B, T, H]
        hidden = self.pre_fc_norm_hidden(state)  # [B, T, H]
        x = self.fc(torch.cat([embeds, hidden], dim=-1))  # [B, T, H]
        cos, sin = self.rope.at(positions, x.dtype)  # [B, 1, T, R] each
        x = self.layers[0](x, cos, sin, positions, mask)  # [B, T, H]
        out = self.norm(x)  # [B, T, H]
        return fp32_logits(lm_head, out), out


def load_mtp(path: str | Path, shared: HeadInputs, target_vocab: int, device, dtype) -> MtpHead:
    """The MTP layer stored in the target checkpoint directory `path` (the target's own files),
    beside a target that shares `shared` (its embeddings, lm_head and width)."""
    from ssdlocal.backends.torch.models import args_from_config
    from ssdlocal.backends.torch.models.moe import stack_experts
    from ssdlocal.backends.torch.packed import Unpacker
    from ssdlocal.weights.formats.archs import architecture
    from ssdlocal.weights.formats.checkpoint import MTP_PREFIX, load_hf_config, mtp_tensor_names, weight_files
    from ssdlocal.weights.formats.safetensors import SafetensorsReader

    path = Path(path).expanduser()
    names = set(mtp_tensor_names(path))
    if not names:
        raise ModelLoadError(f"{path} holds no multi-token-prediction weights (mtp.*)", no_mtp_hint())
    args = args_from_config(load_hf_config(path))
    if not isinstance(args, Qwen3_5Args):
        raise ModelLoadError(f"{path}: MTP layers of a {args.arch} model are not read", no_mtp_hint())
    layers = sorted({n.split(".")[2] for n in names if n.startswith(f"{MTP_PREFIX}layers.")})
    if layers != ["0"]:
        raise ModelLoadError(f"{path} has {len(layers)} MTP layers ({', '.join(layers)}); this version reads one", HINT)
    if args.hidden_size != shared.hidden_size or args.vocab_size != target_vocab:
        raise ModelLoadError(f"{path} is not the target's checkpoint (width or vocabulary differ)", HINT)
    state: dict[str, Tensor] = {}
    unpacker = Unpacker(architecture(args.arch), dtype)  # experts stored fused, as the model's own layers may
    for file in weight_files(path):
        with SafetensorsReader(file) as reader:
            for name in reader.keys():
                if name not in names:
                    continue
                key = name.removeprefix(MTP_PREFIX)  # "layers.0. ...": named as a layer of ours
                parts = unpacker.take(key, reader.read(name))
                state.update({k: t.to(device=device, dtype=dtype) for k, t in parts.items()})
    unpacker.finish(path)
    state = stack_experts(state)  # experts stored one by one -> the stacks the MoE holds
    moe = any(".mlp.experts." in k for k in state)
    if moe and not args.num_experts:
        raise ModelLoadError(f"{path}: an MoE MTP layer in a dense model", HINT)
    with torch.device("meta"):
        head = MtpHead(MtpArgs(args, moe), shared.embeddings, shared.lm_head, target_vocab)
    check_state(head, state, f"{path}'s MTP layer is not one this version reads", HINT)
    head.load_state_dict(state, strict=True, assign=True)
    return head.requires_grad_(False).eval()


def no_mtp_hint() -> str:
    return "--draft mtp reads a Qwen3.5 checkpoint's own MTP layer; use a draft model, a head directory or ngram"
