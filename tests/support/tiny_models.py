"""Tiny random-init checkpoints and a small BPE tokenizer for the test suite.

Everything is written with the public transformers / tokenizers APIs, so the files
look exactly like real Hugging Face checkpoints (config.json, safetensors, tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# fill-in-the-middle tokens as each family's tokenizer names them (a variant's extra specials)
FIM_SPECIALS = {
    "qwen": ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
    "starcoder": ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>", "<file_sep>"],
    "codellama": ["▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"],
}
TOKENIZER_VOCAB = 384
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Speculative decoding lets a small draft model propose tokens that a large target verifies.",
    "Once upon a time there was a little model that wanted to generate text very fast.",
    "In the beginning the weights were random, and the logits were spread out.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(3, 4)\ny = x + 1\nprint(y.shape)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n        self.items.append(item)\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "The cat sat on the mat. The mat was red and the cat was black.",
    "Write a function that returns the sum of a list of numbers.",
    "if __name__ == '__main__':\n    main()\n",
] * 4


def build_tokenizer(out_dir: Path, extra_specials: tuple[str, ...] = ()) -> None:
    """Train a byte-level BPE tokenizer (TOKENIZER_VOCAB tokens) and save it HF-style;
    `extra_specials` (e.g. FIM_SPECIALS["qwen"]) follow SPECIAL_TOKENS as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS + list(extra_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra_specials],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)


def _tokenizer_size(tok_dir: Path) -> int:
    return len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"])


def make_tiny_checkpoint(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    initializer_range: float = 0.15,
    tie_word_embeddings: bool | None = None,
    llama3_rope: bool = False,
    max_shard_size: str | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Random-init a transformers model of `arch` ("llama" | "qwen2" | "qwen3") and save it."""
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        build_tokenizer(out_dir)
    else:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
                shutil.copy(f, out_dir / f.name)
    vocab = _tokenizer_size(out_dir)
    eos = 0  # <|endoftext|> is the first special token
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if llama3_rope:
            rope = {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        cfg = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=bool(tie_word_embeddings))
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
        )
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(
            **common,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
        )
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def make_draft_like(target_dir: Path, out_dir: Path, noise: float = 0.004, seed: int = 1) -> Path:
    """Copy `target_dir` with Gaussian noise (std `noise`) added to every weight matrix.

    With the default noise the draft's greedy token matches the target's ~80% of the time.
    """
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(out_dir.glob("*.safetensors")):
        state = load_file(f)
        for name, t in state.items():
            if t.ndim >= 2:  # leave norms alone: noise there changes every logit at once
                state[name] = t + noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        save_file(state, f, metadata={"format": "pt"})
    return out_dir


def scale_lm_head(directory: Path, factor: float) -> None:
    """Multiply the checkpoint's lm_head by `factor` in place (sharper or flatter logits)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(Path(directory).glob("*.safetensors")):
        state = load_file(f)
        if "lm_head.weight" in state:
            state["lm_head.weight"] = state["lm_head.weight"] * factor
            save_file(state, f, metadata={"format": "pt"})


def make_low_entropy_pair(source: Path, root: Path) -> tuple[Path, Path]:
    """(target, draft) under `root`: a low-entropy copy of `source` and a deliberately
    different, flatter draft (chi-square tests see every kind of rejection)."""
    target = Path(root) / "target"
    shutil.copytree(source, target)
    scale_lm_head(target, 3.0)
    draft = make_draft_like(target, Path(root) / "draft", noise=0.008, seed=21)
    scale_lm_head(draft, 0.8)
    return target, draft


def copy_with_context(source: Path, dest: Path, positions: int) -> Path:
    """A copy of the checkpoint `source` at `dest` whose config allows `positions` positions."""
    shutil.copytree(source, dest)
    config = json.loads((Path(dest) / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (Path(dest) / "config.json").write_text(json.dumps(config))
    return Path(dest)


def make_tiny_suite(root: Path) -> dict[str, Path]:
    """All checkpoints the suite uses, sharing one tokenizer: name -> directory."""
    root = Path(root)
    tok = root / "tokenizer"
    build_tokenizer(tok)
    dirs = {
        "llama": make_tiny_checkpoint(root / "llama", "llama", seed=0, tokenizer_dir=tok),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2", seed=1, tokenizer_dir=tok),
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", seed=2, tokenizer_dir=tok),
        "llama3_rope": make_tiny_checkpoint(root / "llama3_rope", "llama", seed=3, llama3_rope=True, tokenizer_dir=tok),
    }
    dirs["draft_llama"] = make_draft_like(dirs["llama"], root / "draft_llama", noise=0.004, seed=10)
    dirs["draft_qwen2"] = make_draft_like(dirs["qwen2"], root / "draft_qwen2", noise=0.004, seed=11)
    dirs["small_llama"] = make_tiny_checkpoint(
        root / "small_llama",
        "llama",
        seed=4,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        tokenizer_dir=tok,
    )
    return dirs


def make_fim_checkpoint(root: Path, style: str = "qwen", seed: int = 5) -> Path:
    """A tiny qwen2 checkpoint whose tokenizer has `style`'s FIM tokens (FIM_SPECIALS), in
    `root/fim_<style>`; the default tokenizer (no FIM tokens) is left as it is."""
    root = Path(root)
    tok = root / f"fim_{style}_tokenizer"
    build_tokenizer(tok, tuple(FIM_SPECIALS[style]))
    return make_tiny_checkpoint(root / f"fim_{style}", "qwen2", seed=seed, tokenizer_dir=tok)


def make_turn_ender(source: Path, dest: Path, prompt_ids: list[int], end: str = "<|im_end|>", at: int = 3) -> int:
    """A copy of the untied checkpoint `source` at `dest` that ends its turn with the special
    token `end` (made an end-of-sequence id) after a few tokens of greedy answer to
    `prompt_ids`, as a chat model does: `end`'s lm_head row becomes 1.05 x the row of the
    token greedy decoding emits at index `at` (a positive logit there), so `end` outscores
    it there or earlier. Returns how many tokens come before `end` (at least 1)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(source, dest)
    end_id = AutoTokenizer.from_pretrained(dest).convert_tokens_to_ids(end)

    def greedy() -> list[int]:
        model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
        ids, out = list(prompt_ids), []
        with torch.no_grad():
            for _ in range(at + 8):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                out.append(int(logits.argmax()))
                ids.append(out[-1])
                if out[-1] == end_id:
                    break
        return out

    before = greedy()
    files = sorted(Path(dest).glob("*.safetensors"))
    for index in range(at, len(before)):  # the first candidate whose logit is positive
        state = {f: load_file(f) for f in files}
        head = next((f, s) for f, s in state.items() if "lm_head.weight" in s)
        weight = head[1]["lm_head.weight"]
        weight[end_id] = 1.05 * weight[before[index]]
        save_file(head[1], head[0], metadata={"format": "pt"})
        after = greedy()
        if after[-1] == end_id and len(after) >= 2:
            gen = json.loads((Path(dest) / "generation_config.json").read_text())
            gen["eos_token_id"] = [0, end_id]
            (Path(dest) / "generation_config.json").write_text(json.dumps(gen))
            return len(after) - 1
        shutil.copy(Path(source) / head[0].name, head[0])
    raise RuntimeError("no token of the greedy answer could be made to end the turn")  # pragma: no cover
