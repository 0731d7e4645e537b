"""Our native forward pass against transformers, tree masks, batching, and loader errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ssdlocal.backends.torch.loader import load_model
from ssdlocal.backends.torch.models import args_from_config, causal_mask
from ssdlocal.core.errors import ModelLoadError, UnsupportedArchitectureError
from ssdlocal.weights.formats.checkpoint import load_tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "llama3_rope"]
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """Prefill, then one token at a time with causal masks (slot == position)."""
    S = len(prompt_ids) + max_new_tokens
    model.setup_cache(1, S, torch.float32, "cpu")
    ids = torch.tensor([prompt_ids])  # [1, T]
    pos = torch.arange(len(prompt_ids))[None]  # [1, T]
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(ids, pos, pos, causal_mask(pos, S))  # [1, T, V]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos:
            break
        ids = torch.tensor([[tok]])  # [1, 1]
        pos = pos[:, -1:] + 1  # [1, 1]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(tiny_dir, arch):
    loaded = load_model(tiny_dir[arch], dtype="float32")
    ref = hf_model(tiny_dir[arch])
    for prompt in PROMPTS:
        ids = loaded.tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            expected = ref.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=24,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        expected = expected[0, len(ids) :].tolist()
        assert greedy(loaded.model, ids, 24, loaded.eos_token_ids) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_forward(tiny_dir, arch):
    loaded = load_model(tiny_dir[arch], dtype="float32")
    ref = hf_model(tiny_dir[arch])
    ids = torch.randint(3, loaded.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # [2, 40]
    pos = torch.arange(40)[None].expand(2, 40)  # [2, 40]
    loaded.model.setup_cache(2, 48, torch.float32, "cpu")
    with torch.inference_mode():
        ours = loaded.model(ids, pos, pos, causal_mask(pos, 48))  # [2, 40, V]
        theirs = ref(ids).logits.float()  # [2, 40, V]
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_tree_mask_equals_linear_branches(tiny_dir):
    model = load_model(tiny_dir["qwen3"]).model
    prefix, branch_a, branch_b = [5, 17, 40, 99, 7], [11, 12, 13], [200, 201]
    n, S = len(prefix), 16

    def linear(tokens):
        model.setup_cache(1, S, torch.float32, "cpu")
        pos = torch.arange(len(tokens))[None]  # [1, T]
        return model(torch.tensor([tokens]), pos, pos, causal_mask(pos, S))[0]  # [T, V]

    want_a, want_b = linear(prefix + branch_a)[n:], linear(prefix + branch_b)[n:]

    # Prefix in slots 0..4; branch a in slots 5..7, branch b in slots 8..9, one forward.
    model.setup_cache(1, S, torch.float32, "cpu")
    pos = torch.arange(n)[None]  # [1, n]
    model(torch.tensor([prefix]), pos, pos, causal_mask(pos, S))
    tokens = torch.tensor([branch_a + branch_b])  # [1, 5]
    positions = torch.tensor([[n, n + 1, n + 2, n, n + 1]])  # [1, 5]
    slots = torch.tensor([[n, n + 1, n + 2, n + 3, n + 4]])  # [1, 5]
    mask = torch.zeros(1, 5, S, dtype=torch.bool)  # [1, 5, S]
    mask[:, :, :n] = True
    for t, visible in enumerate([[5], [5, 6], [5, 6, 7], [8], [8, 9]]):
        mask[0, t, visible] = True
    got = model(tokens, positions, slots, mask)[0]  # [5, V]
    torch.testing.assert_close(got[:3], want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3:], want_b, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_batch_with_right_padding_equals_single_rows(tiny_dir):
    loaded = load_model(tiny_dir["llama"])
    model, eos = loaded.model, loaded.eos_token_ids
    prompts = [loaded.tokenizer(p)["input_ids"] for p in ["import torch\nx = torch.zeros(3)", "Hello"]]
    singles = [greedy(model, p, 12, ()) for p in prompts]

    S = max(map(len, prompts)) + 12
    model.setup_cache(2, S, torch.float32, "cpu")
    T = max(map(len, prompts))
    ids = torch.tensor([p + [eos[0]] * (T - len(p)) for p in prompts])  # [2, T] right padded
    pos = torch.arange(T)[None].expand(2, T)  # [2, T]
    lengths = torch.tensor([len(p) for p in prompts])  # [2]
    logits = model(ids, pos, pos, causal_mask(pos, S))  # [2, T, V]; padding rows are ignored
    nxt = logits[torch.arange(2), lengths - 1].argmax(-1)  # [2]
    outs = [[int(nxt[0])], [int(nxt[1])]]
    cur = lengths.clone()  # [2] position of the next token per row (padding slots get overwritten)
    for _ in range(11):
        pos = cur[:, None]  # [2, 1]
        logits = model(nxt[:, None], pos, pos, causal_mask(pos, S))  # [2, 1, V]
        nxt = logits[:, 0].argmax(-1)  # [2]
        for row in range(2):
            outs[row].append(int(nxt[row]))
        cur += 1
    assert outs == singles


def test_model_args_from_configs(tiny_dir):
    from transformers import AutoConfig, LlamaConfig

    args = args_from_config(AutoConfig.from_pretrained(tiny_dir["qwen2"]))
    assert (args.arch, args.qkv_bias, args.qk_norm, args.tie_word_embeddings) == ("qwen2", True, False, True)
    args = args_from_config(AutoConfig.from_pretrained(tiny_dir["qwen3"]))
    assert (args.arch, args.qk_norm, args.head_dim) == ("qwen3", True, 32)
    args = args_from_config(AutoConfig.from_pretrained(tiny_dir["llama3_rope"]))
    assert args.rope_scaling["rope_type"] == "llama3" and args.rope_theta == 500000.0
    cfg = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedArchitectureError):
        args_from_config(cfg)


def test_sharded_checkpoint_and_bf16(tiny_dir, tmp_path):
    from support.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / "sharded", "qwen2", seed=1, max_shard_size="50KB", tokenizer_dir=tiny_dir["qwen2"]
    )
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    sharded, single = load_model(path), load_model(tiny_dir["qwen2"])
    for a, b in zip(sharded.model.state_dict().values(), single.model.state_dict().values()):
        assert torch.equal(a, b)
    half = load_model(path, dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and half.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half.model.lm_head.weight is half.model.embed_tokens.weight  # tied
    half.model.setup_cache(1, 8, torch.bfloat16, "cpu")
    pos = torch.arange(4)[None]  # [1, 4]
    with torch.inference_mode():
        logits = half.model(torch.tensor([[3, 4, 5, 6]]), pos, pos, causal_mask(pos, 8))  # [1, 4, V]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_whole_checkpoints_load_without_a_memory_map(tiny_dir, monkeypatch):
    """Touched pages of a memory-mapped file stay resident until it closes, which doubled
    the peak of a float load; whole tensors are read with plain file I/O instead."""
    from ssdlocal.backends.torch import loader

    reference = {k: v.clone() for k, v in load_model(tiny_dir["llama"]).model.state_dict().items()}

    def no_map(*args, **kwargs):
        raise AssertionError("a whole-checkpoint load memory-mapped its file")

    monkeypatch.setattr(loader, "safe_open", no_map)
    loaded = load_model(tiny_dir["llama"]).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.items())


def test_loaded_model_metadata(tiny_dir):
    loaded = load_model(tiny_dir["llama"])
    assert loaded.eos_token_ids == (0,)
    assert loaded.args.vocab_size == len(loaded.tokenizer)
    assert load_tokenizer(tiny_dir["llama"]).chat_template


def _hint(exc_info) -> str:
    assert exc_info.value.hint
    return exc_info.value.message


def test_loader_errors(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "nope")
    assert "does not exist" in _hint(e)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "empty")
    assert "config.json" in _hint(e)

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_dir["llama"], no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(no_weights)
    assert "safetensors" in _hint(e)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(gpt2)
    assert "GPT2LMHeadModel" in _hint(e) and "Qwen2ForCausalLM" in e.value.hint

    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    with pytest.raises(UnsupportedArchitectureError):
        load_model(weird)

    # Weights from one architecture under another's config: names do not match.
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_dir["qwen3"], mixed)
    shutil.copy(tiny_dir["qwen2"] / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        load_model(mixed)
    assert "missing" in _hint(e) or "the weight files hold" in _hint(e)  # names, or sizes checked first

    with pytest.raises(ModelLoadError):
        load_model(tiny_dir["llama"], dtype="float8")
