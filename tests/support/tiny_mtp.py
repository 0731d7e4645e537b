"""Multi-token-prediction layers in tiny Qwen3.5 checkpoints, as the published ones ship them
(`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` named as
the model's own full-attention layers, `mtp.norm`), and a reference MTP forward composed of
transformers' own Qwen3.5 modules (its decoder layer, zero-centred RMSNorm and rotary table)
by the published formula, independent of ssdlocal's code.

`add_mtp` writes random MTP tensors into a checkpoint; `make_copying_pair` builds a target
that is a bigram model (every branch of its layers zeroed: its logits after token t are
lm_head(norm(embed(t)))) with an MTP layer built to compute exactly that function of the
token it is given, so that its drafts are the target's greedy choices.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn


def _decoder_layer(target_dir: Path):
    """transformers' decoder layer of the target's config, as one of its full-attention layers."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target_dir)
    cfg._attn_implementation = "eager"
    index = list(cfg.layer_types).index("full_attention")
    if getattr(cfg, "num_experts", 0):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer  # type: ignore[assignment]
    return cfg, Layer(cfg, index)


def _per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A transformers layer's fused experts (gate_up_proj [E, 2I, H], gate rows first;
    down_proj [E, H, I]) as a published checkpoint stores them, one expert at a time."""
    prefix = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        parts = {"gate_proj": gate, "up_proj": up}
    elif name.endswith("experts.down_proj"):
        parts = {"down_proj": tensor}
    else:
        return {name: tensor}
    return {f"{prefix}.{e}.{p}.weight": w[e] for p, w in parts.items() for e in range(w.shape[0])}


def add_mtp(target_dir: Path, seed: int = 50, std: float = 0.15) -> dict[str, torch.Tensor]:
    """Random MTP tensors written into the checkpoint at `target_dir` (its one
    *.safetensors file); returns them as stored (`mtp.*`)."""
    from safetensors.torch import load_file, save_file

    cfg, layer = _decoder_layer(target_dir)
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * std / 2}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"{name}.weight"] = 0.3 * torch.randn(h, generator=gen)  # zero-centred: scale 1 + weight
    for name, p in layer.state_dict().items():
        value = (
            0.3 * torch.randn(p.shape, generator=gen) if "norm" in name else torch.randn(p.shape, generator=gen) * std
        )
        for stored, t in _per_expert(f"layers.0.{name}", value).items():
            tensors[stored] = t
    mtp = {f"mtp.{k}": v.contiguous() for k, v in tensors.items()}
    (file,) = Path(target_dir).glob("*.safetensors")
    state = load_file(file)
    state.update(mtp)
    save_file(state, file, metadata={"format": "pt"})
    return mtp


class ReferenceMtp(nn.Module):
    """The MTP forward by the published formula with transformers' modules: over a whole
    sequence of pairs (token q + 1, state after token q) at positions q, causal, no cache."""

    def __init__(self, target_dir: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding

        super().__init__()
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        cfg, self.layer = _decoder_layer(target_dir)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.norm = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(cfg)
        (file,) = Path(target_dir).glob("*.safetensors")
        stored = {k.removeprefix("mtp."): v for k, v in load_file(file).items() if k.startswith("mtp.")}
        ours = {}
        for name, p in self.layer.state_dict().items():  # the layer's fused experts from the stored ones
            key = f"layers.0.{name}"
            if name.endswith("gate_up_proj"):
                e = p.shape[0]
                prefix = key.rsplit(".", 1)[0]
                ours[name] = torch.stack(
                    [
                        torch.cat([stored[f"{prefix}.{i}.gate_proj.weight"], stored[f"{prefix}.{i}.up_proj.weight"]])
                        for i in range(e)
                    ]
                )
            elif name.endswith("experts.down_proj"):
                prefix = key.rsplit(".", 1)[0]
                ours[name] = torch.stack([stored[f"{prefix}.{i}.down_proj.weight"] for i in range(p.shape[0])])
            else:
                ours[name] = stored[key]
        self.layer.load_state_dict(ours)
        for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            getattr(self, name).load_state_dict({"weight": stored[f"{name}.weight"]})
        self.eval()

    @torch.no_grad()
    def final_states(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states (after its norm) of `ids` [1, T] -> [1, T, H]."""
        return self.target.model(input_ids=ids).last_hidden_state

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor):
        """tokens [1, T] (token q + 1), states [1, T, H] (after token q), positions [1, T] (q)
        -> (logits [1, T, V], the normed output [1, T, H])."""
        embeds = self.target.get_input_embeddings()(tokens)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(states)], dim=-1))
        t = tokens.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
        x = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask, position_ids=positions)
        out = self.norm(x)
        return self.target.lm_head(out), out


def make_copying_pair(source: Path, out_dir: Path) -> Path:
    """A copy of the Qwen3.5 checkpoint `source` made a bigram model (attention, linear
    attention and MLP outputs zeroed in every layer), with an MTP layer whose attention and
    MLP outputs are zeroed too, `fc` passing the normed embedding through (the hidden half
    zero, its input norm a constant scale) and `mtp.norm` the target's final norm (drawn far
    from 1, so that it decides tokens): the head's logits for the token it is given are the
    target's logits after that token (up to rounding)."""
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(source, out_dir))
    (file,) = out.glob("*.safetensors")
    add_mtp(out)
    state = load_file(file)
    for name in list(state):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
    h = state["mtp.fc.weight"].shape[0]
    state["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    state["mtp.pre_fc_norm_embedding.weight"] = torch.ones(h)  # scale 2: the final norm undoes it
    gen = torch.Generator().manual_seed(52)
    state["model.norm.weight"] = 1.5 * torch.randn(h, generator=gen)  # a final norm that changes the choice
    state["mtp.norm.weight"] = state["model.norm.weight"].clone()
    save_file(state, file, metadata={"format": "pt"})
    return out
