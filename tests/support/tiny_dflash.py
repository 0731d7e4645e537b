"""Tiny DFlash block drafters for a tiny target checkpoint, written with transformers' own
classes (MuseGlimmerAssistantConfig / MuseGlimmerAssistantModel, `save_pretrained`), and
the same weights in z-lab's layout (`DFlashDraftModel`: fc, hidden_norm, a Qwen3 config
with a dflash_config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_dflash(
    out_dir: Path,
    target_dir: Path,
    seed: int = 50,
    block_size: int = 4,
    target_layer_ids=(0, 1),
    layers: int = 2,
    sliding_window: int | None = None,
    mask_token_id: int = 3,
) -> Path:
    """A random transformers-form DFlash drafter for the target at `target_dir` (its width);
    full attention unless `sliding_window` (then every layer slides, transformers' default)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    target = json.loads((Path(target_dir) / "config.json").read_text())
    h = target["hidden_size"]
    config = MuseGlimmerAssistantConfig(
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=h // 4,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=target["max_position_embeddings"],
        sliding_window=sliding_window or 4096,
        layer_types=["sliding_attention" if sliding_window else "full_attention"] * layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(config).eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def as_zlab(source: Path, out_dir: Path) -> Path:
    """The drafter at `source` (transformers' form, full attention) in z-lab's layout."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((Path(source) / "config.json").read_text())
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": raw["block_size"],
        "dflash_config": {"mask_token_id": raw["mask_token_id"], "target_layer_ids": raw["target_layer_ids"]},
        "layer_types": ["full_attention"] * raw["num_hidden_layers"],
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        **{
            k: raw[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
                "rope_parameters",
                "max_position_embeddings",
                "hidden_act",
            )
        },
    }
    names = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
    state = {names.get(k, k): v for f in Path(source).glob("*.safetensors") for k, v in load_file(f).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"))
    return out


def train_dflash(
    drafter_dir: Path, target_dir: Path, prompts: list[list[int]], steps: int = 180, new: int = 40
) -> None:
    """Train the drafter at `drafter_dir` in place (DFlash's objective: from the target's
    hidden states before an anchor and [anchor token, masks], predict the target's next
    block_size - 1 greedy tokens) on the target's greedy continuations of `prompts` (token
    lists of one length), so rounds accept some drafts and not others (about 5 s here)."""
    from transformers import AutoModelForCausalLM, MuseGlimmerAssistantModel

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    drafter = MuseGlimmerAssistantModel.from_pretrained(drafter_dir, dtype=torch.float32)
    ids = torch.tensor(prompts)  # [N, P]
    with torch.no_grad():
        seqs = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        states = target(seqs, output_hidden_states=True).hidden_states
    context = torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)  # [N, P + new, n x D]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    bs, first = drafter.config.block_size, ids.shape[1]
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        anchor = int(torch.randint(first, seqs.shape[1] - bs + 1, ()))
        noise = torch.full((len(prompts), bs), drafter.config.mask_token_id)
        noise[:, 0] = seqs[:, anchor]
        positions = torch.arange(anchor + bs)[None].expand(len(prompts), -1)
        embeds = embed(noise)
        hidden = drafter(noise_embeds=embeds, context_hidden_states=context[:, :anchor], position_ids=positions)
        logits = head(hidden.last_hidden_state[:, 1:])  # [N, bs - 1, V]
        labels = seqs[:, anchor + 1 : anchor + bs]  # [N, bs - 1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval().save_pretrained(drafter_dir)


def transformers_rounds(target_dir: Path, drafter_dir: Path, prompt: list[int], new: int, raw_rows: bool = False):
    """transformers' assisted generation with speculation_type="dflash" (greedy, float32,
    no stop at end-of-sequence): (the tokens it generated, {tokens held before the round:
    the round's candidates}). `raw_rows`: the block's embeddings are the table's rows
    unscaled, as z-lab's dflash_generate reads them (F.embedding of the target's weight)."""
    import pytest
    from transformers import AutoModelForCausalLM, MuseGlimmerAssistantModel
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.generation_config.eos_token_id = None
    drafter = MuseGlimmerAssistantModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    rounds: dict[int, list[int]] = {}
    original = DFlashTokenCandidateGenerator.get_candidates

    def recorded(self, input_ids, *args, **kwargs):
        out, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:  # the first call only lets the target read the prompt
            rounds[input_ids.shape[1]] = out[0, input_ids.shape[1] :].tolist()
        return out, logits

    ids = torch.tensor([prompt])
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(DFlashTokenCandidateGenerator, "get_candidates", recorded)
        if raw_rows:
            mp.setattr(
                DFlashTokenCandidateGenerator,
                "_get_noise_embeds",
                lambda self, ids: torch.nn.functional.embedding(ids, self.main_model_input_embeddings.weight),
            )
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=drafter,
            speculation_type="dflash",
            max_new_tokens=new,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist(), rounds
