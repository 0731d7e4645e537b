"""Target/draft compatibility: can the draft's tokens be verified by the target?

Works on tokenizers (and config.json) only, so it runs before any weights are loaded.
Checks, in order: tokenizer type, tokenizer vocabulary size (exact), config vocab sizes
(loose: padded embedding rows such as Qwen's 151936 vs 152064 are fine as long as
every real token has a row), token texts over the shared id range, special tokens.
A different chat template is only a warning: prompts are formatted with the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import IncompatiblePairError

_HINT = (
    "use a draft from the same model family that shares the target's tokenizer "
    "(e.g. Qwen2.5-Coder-1.5B + Qwen2.5-Coder-0.5B), or --draft ngram"
)


@dataclass(frozen=True)
class CompatReport:
    """What passed: the checks run, plus warnings that do not block the pair."""

    checks: tuple[str, ...]
    warnings: tuple[str, ...] = ()


def _hint(family: str | None = None) -> str:
    try:
        from ssdlocal.weights.pairs import suggest_pairs

        names = suggest_pairs(family)
    except Exception:  # noqa: BLE001 - suggestions must never hide the real error
        names = []
    if not names:
        return _HINT
    return f"{_HINT}; known-good pairs: {', '.join(names)} (`ssdlocal pairs` lists all)"


def _fail(message: str, family: str | None) -> IncompatiblePairError:
    return IncompatiblePairError(message, _hint(family))


def _tokenizer_kind(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    return type(model).__name__ if model is not None else type(tok).__name__


def check_pair(
    target_tok,
    draft_tok,
    *,
    target_vocab: int | None = None,
    draft_vocab: int | None = None,
    family: str | None = None,
) -> CompatReport:
    """Raise IncompatiblePairError naming the first check that fails.

    `target_vocab` / `draft_vocab` are the models' embedding sizes (config vocab_size),
    compared loosely; the tokenizers themselves must agree exactly.
    """
    t_kind, d_kind = _tokenizer_kind(target_tok), _tokenizer_kind(draft_tok)
    if t_kind != d_kind:
        raise _fail(
            f"tokenizer type check failed: target uses {t_kind}, draft uses {d_kind}", family
        )
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(t_vocab) != len(d_vocab):
        raise _fail(
            f"vocabulary size check failed: target tokenizer has {len(t_vocab)} tokens, "
            f"draft has {len(d_vocab)}",
            family,
        )
    for who, rows, vocab in (("target", target_vocab, t_vocab), ("draft", draft_vocab, d_vocab)):
        top = max(vocab.values(), default=-1)
        if rows is not None and rows < top + 1:
            raise _fail(
                f"vocabulary size check failed: the {who} model has {rows} embedding rows but "
                f"its tokenizer uses ids up to {top} ({len(vocab)} tokens)",
                family,
            )
    if t_vocab != d_vocab:
        t_by_id = {i: t for t, i in t_vocab.items()}
        d_by_id = {i: t for t, i in d_vocab.items()}
        shared = sorted(set(t_by_id) | set(d_by_id))
        bad = [i for i in shared if t_by_id.get(i) != d_by_id.get(i)]
        shown = ", ".join(f"id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}" for i in bad[:3])
        raise _fail(
            f"token text check failed: target and draft map tokens to different ids "
            f"({len(bad)} ids differ; {shown})",
            family,
        )
    for attr in ("eos_token", "bos_token", "unk_token"):
        t_val, d_val = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if t_val != d_val:
            raise _fail(
                f"special token check failed: {attr.removesuffix('_token')} is {t_val!r} for the "
                f"target but {d_val!r} for the draft",
                family,
            )
    t_special = set(getattr(target_tok, "all_special_tokens", []) or [])
    d_special = set(getattr(draft_tok, "all_special_tokens", []) or [])
    warnings = []
    if t_special != d_special:
        diff = sorted(t_special ^ d_special)[:4]
        warnings.append(
            f"special token sets differ ({', '.join(map(repr, diff))}); ids agree, so drafting works"
        )
    t_tmpl, d_tmpl = (
        getattr(target_tok, "chat_template", None),
        getattr(draft_tok, "chat_template", None),
    )
    if t_tmpl != d_tmpl:
        warnings.append("chat templates differ; prompts are formatted with the target's template")
    checks = ("tokenizer type", "vocabulary size", "token texts", "special tokens", "chat template")
    return CompatReport(checks, tuple(warnings))


def config_vocab_size(checkpoint: Path) -> tuple[int | None, str | None]:
    """(vocab_size, model_type) from a checkpoint's config.json; Nones if unreadable."""
    try:
        raw = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    vocab = text.get("vocab_size")
    return (vocab if isinstance(vocab, int) else None), raw.get("model_type")


def check_paths(target: str | Path, draft: str | Path) -> CompatReport:
    """check_pair on two checkpoints (dirs or .gguf files), reading no weights."""
    from ssdlocal.backends.torch.loader import config_dir, load_tokenizer

    t_dir, d_dir = config_dir(target), config_dir(draft)
    t_vocab, family = config_vocab_size(t_dir)
    d_vocab, _ = config_vocab_size(d_dir)
    family = {"llama": "llama3", "qwen2": "qwen2.5"}.get(family or "", family)
    return check_pair(
        load_tokenizer(t_dir),
        load_tokenizer(d_dir),
        target_vocab=t_vocab,
        draft_vocab=d_vocab,
        family=family,
    )
