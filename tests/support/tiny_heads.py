"""Tiny draft heads in their published formats, for a tiny target checkpoint.

`make_eagle3` writes an EAGLE-3 head directory (config.json + model.safetensors) as the
SafeAILab / SGLang / vLLM checkpoints are laid out: fc [H, 3H], midlayer.* (q/k/v over
2H), norm, lm_head over a reduced draft vocabulary, d2t (draft id -> target id offset), t2d.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_eagle3(
    out_dir: Path,
    target_dir: Path,
    seed: int = 40,
    draft_vocab: int = 200,
    aux=(1, 1, 2),
    heads: int = 4,
    kv: int = 2,
    inter: int | None = None,
) -> Path:
    """A random EAGLE-3 head for the target at `target_dir` (its width and vocabulary); the
    draft vocabulary is `draft_vocab` target ids spread over the vocabulary. `heads`, `kv`
    and `inter` (default 2 x width) shape its one layer (timing shapes use a real head's)."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    head_dim, inter = h // heads, inter or 2 * h
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    ids = torch.linspace(0, vocab - 1, draft_vocab).round().long().unique()  # sorted target ids
    state = {
        "fc.weight": rand(h, 3 * h, std=0.08),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rand(len(ids), h, std=0.5),
        "d2t": ids - torch.arange(len(ids)),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": len(ids),
        "max_position_embeddings": target["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def make_gemma4_assistant(
    out_dir: Path, target_dir: Path, seed: int = 41, steps: int = 0, ordered: bool = True, **changes
) -> Path:
    """A Gemma 4 MTP assistant for the Gemma 4 target at `target_dir`, written with
    transformers' own classes (Gemma4AssistantConfig, Gemma4AssistantForCausalLM) as the
    published ones are: four KV-sharing layers (three sliding, one full, the target's head
    widths), a masked vocabulary of 16 centroids (4 scored) over a random token ordering
    (`ordered`), tied embeddings. With `steps`, its readout is fitted in that many steps to
    the target's greedy choices (fit_assistant), so that its drafts are often accepted;
    otherwise its weights are random."""
    from transformers import AutoConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    target = AutoConfig.from_pretrained(target_dir)
    vocab, types = target.vocab_size, list(target.layer_types)
    local, full = (target.per_layer_config[types.index(kind)] for kind in ("sliding_attention", "full_attention"))
    text = dict(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=local.num_key_value_heads,
        head_dim=local.head_dim,
        global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads,
        attention_k_eq_v=target.attention_k_eq_v,
        sliding_window=target.sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters=target.rope_parameters,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**{**text, **changes}),
        backbone_hidden_size=target.hidden_size,
        use_ordered_embeddings=ordered,
        num_centroids=16,
        centroid_intermediate_top_k=4,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.7 + 0.1 * i)
            if steps:  # the layers' branches small beside the token's embedding, which the readout is fitted to
                layer.post_attention_layernorm.weight.mul_(0.2)
                layer.post_feedforward_layernorm.weight.mul_(0.2)
        if steps:  # the state's half of the input small too
            model.pre_projection.weight[:, target.hidden_size :].mul_(0.1)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=gen))
    if steps:
        fit_assistant(model, target_dir, seed, steps)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def fit_assistant(
    assistant, target_dir: Path, seed: int, steps: int, rows: int = 32, length: int = 40, depth: int = 3
) -> None:
    """Fit `assistant`'s lm_head (its tied embedding table) and centroids, its other weights
    kept, so that it drafts what the target would choose: transformers' own forward of the
    assistant over random token sequences gives its final hidden states (at position q + 1
    the target's final hidden state after token q and token q + 1, keys up to q, the last
    sliding_window + 1 in the sliding layers; `depth` drafts deep, the later ones from its
    own states, fed the sequence's next tokens); the readout is then trained by cross-entropy
    against the target's greedy choice after each of them (with a masked vocabulary, the
    centroids against that choice's centroid). A linear fit on fixed features: seconds."""
    from transformers import Gemma4ForCausalLM

    target = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    seqs = torch.randint(1, vocab, (rows, length), generator=gen)  # [R, L]
    q = torch.arange(0, length - depth)  # the position of the state a round starts from
    slots = torch.arange(length)
    full = slots[None, :] <= q[:, None]  # [Q, L]
    window = assistant.config.get_text_config().sliding_window
    masks = {"full_attention": full, "sliding_attention": full & (slots[None, :] >= q[:, None] - window)}
    masks = {k: m[None, None].expand(rows, 1, -1, -1) for k, m in masks.items()}  # [R, 1, Q, L]
    features, labels = [], []
    with torch.no_grad():
        out = target(input_ids=seqs, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        chosen = out.logits.argmax(-1)  # [R, L]: the target's greedy token after each position
        embeds = target.get_input_embeddings()(seqs)  # [R, L, D], scaled
        state = out.hidden_states[-1][:, q]  # [R, Q, D]: normed, what the target's lm_head reads
        for j in range(depth):
            x = assistant.pre_projection(torch.cat([embeds[:, q + 1 + j], state], dim=-1))  # [R, Q, H]
            h = assistant.model(
                inputs_embeds=x,
                attention_mask=masks,
                position_ids=(q + 1)[None].expand(rows, -1),
                shared_kv_states=dict(out.shared_kv_states),
            ).last_hidden_state  # [R, Q, H]
            features.append(h.flatten(0, 1))
            labels.append(chosen[:, q + 1 + j].flatten())  # the target's choice after token q + 1 + j
            state = assistant.post_projection(h)
    h, y = torch.cat(features), torch.cat(labels)  # [N, H], [N]
    _fit(assistant.lm_head.weight, h, y, steps)
    masked = assistant.masked_embedding
    if masked is not None:  # centroids: balanced clusters of the fitted lm_head rows, then fitted
        clusters = _balanced_clusters(assistant.lm_head.weight.detach(), masked.num_centroids, gen)
        with torch.no_grad():
            masked.token_ordering.copy_(torch.argsort(clusters, stable=True))  # each centroid's tokens in turn
            masked.centroids.weight.copy_(
                torch.stack([assistant.lm_head.weight[clusters == c].mean(0) for c in range(masked.num_centroids)])
            )
        _fit(masked.centroids.weight, h, clusters[y], steps)
    assistant.requires_grad_(False)


def _fit(weight, features, labels, steps: int) -> None:
    """`steps` Adam steps of cross-entropy of features @ weight.T [N, C] against labels [N]."""
    weight.requires_grad_(True)
    optimizer = torch.optim.Adam([weight], lr=0.05)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(features @ weight.T, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weight.requires_grad_(False)


def _balanced_clusters(rows, count: int, gen, rounds: int = 8):
    """Each row of `rows` [V, H] assigned to one of `count` clusters of exactly V / count rows
    (k-means, the most confident rows choosing first) -> [V] long."""
    size = rows.shape[0] // count
    centers = rows[torch.randperm(rows.shape[0], generator=gen)[:count]]  # [C, H]
    for _ in range(rounds):
        scores = rows @ centers.T  # [V, C]
        assign = torch.empty(rows.shape[0], dtype=torch.long)
        taken = [0] * count
        for t in scores.max(1).values.argsort(descending=True).tolist():
            c = next(c for c in scores[t].argsort(descending=True).tolist() if taken[c] < size)
            assign[t], taken[c] = c, taken[c] + 1
        centers = torch.stack([rows[assign == c].mean(0) for c in range(count)])
    return assign


def make_gemma4_predictable(out_dir: Path, tokenizer_dir: Path) -> Path:
    """tests/support/tiny_families.py's Gemma 4 with its attention branches scaled down
    (post-attention norms x 0.02) and its logits sharpened (final norm x 3): its greedy choice
    depends mostly on the newest token, so an assistant whose readout is fitted to it
    (make_gemma4_assistant with `steps`) drafts well, and sampling at T = 1 is low-entropy."""
    from support.tiny_families import make_gemma4
    from transformers import Gemma4ForCausalLM

    out = make_gemma4(Path(out_dir), tokenizer_dir)
    model = Gemma4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.mul_(0.02)
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(out)
    return out
