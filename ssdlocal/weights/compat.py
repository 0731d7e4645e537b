"""Target/draft compatibility: can the draft's tokens be verified by the target?

Works on tokenizers (and config.json) only, so it runs before any weights are loaded.
Checks, in order: tokenizer type; embedding rows (padded rows such as Qwen's 151936 vs
152064 are fine as long as every real token has a row, and the draft can embed every
id the target side feeds it); token texts over the ids the draft can propose; the
eos/bos/unk ids. Differences the draft never meets (added tokens past the embedding
rows, ids it cannot propose) and a different chat template are only warnings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ssdlocal.core.errors import IncompatiblePairError
from ssdlocal.core.models import BackendName
from ssdlocal.weights.formats.archs import find

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


def _added_ids(tok) -> set[int]:
    get = getattr(tok, "get_added_vocab", None)
    return set(get().values()) if callable(get) else set()


def _reach(tok, vocab: dict[str, int], rows: int | None) -> tuple[int, list[str]]:
    """(highest id the model can be fed or emit, added tokens past its embedding rows).

    Added tokens past the rows (transformers adds e.g. <|endoftext|> to some tokenizers)
    never reach the model unless typed into a prompt: a warning, not a failure."""
    added = _added_ids(tok)
    beyond = sorted(t for t, i in vocab.items() if rows is not None and i >= rows and i in added)
    kept = [i for i in vocab.values() if rows is None or i < rows or i not in added]
    return max(kept, default=-1), beyond


def check_pair(
    target_tok,
    draft_tok,
    *,
    target_vocab: int | None = None,
    draft_vocab: int | None = None,
    family: str | None = None,
) -> CompatReport:
    """Raise IncompatiblePairError naming the first check that fails.

    `target_vocab` / `draft_vocab` are the models' embedding rows (config vocab_size;
    None when unknown). What must agree: every id the draft can emit maps to the same
    token text in both tokenizers, the draft can embed every id the target side feeds
    it, and the special (eos/bos/unk) ids. Other differences are warnings.
    """
    t_kind, d_kind = _tokenizer_kind(target_tok), _tokenizer_kind(draft_tok)
    if t_kind != d_kind:
        raise _fail(f"tokenizer type check failed: target uses {t_kind}, draft uses {d_kind}", family)
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    warnings: list[str] = []
    tops = {}
    for who, tok, rows, vocab in (
        ("target", target_tok, target_vocab, t_vocab),
        ("draft", draft_tok, draft_vocab, d_vocab),
    ):
        top, beyond = _reach(tok, vocab, rows)
        tops[who] = top
        if rows is not None and rows < top + 1:
            raise _fail(
                f"vocabulary size check failed: the {who} model has {rows} embedding rows but "
                f"its tokenizer uses ids up to {top} ({len(vocab)} tokens)",
                family,
            )
        if beyond:
            warnings.append(
                f"the {who} tokenizer has added tokens past its model's {rows} "
                f"embedding rows ({', '.join(beyond[:3])}); the model never emits them"
            )
    draft_span = draft_vocab if draft_vocab is not None else tops["draft"] + 1
    if tops["target"] >= draft_span:
        has = (
            f"{draft_vocab} embedding rows"
            if draft_vocab is not None
            else f"{len(d_vocab)} tokens (ids up to {tops['draft']})"
        )
        raise _fail(
            f"vocabulary size check failed: the target tokenizer has {len(t_vocab)} tokens "
            f"(ids up to {tops['target']}) but the draft has {has}",
            family,
        )
    _check_texts(t_vocab, d_vocab, min(draft_span, target_vocab or tops["target"] + 1), family, warnings)
    _check_special_ids(target_tok, draft_tok, family)
    warnings += _soft_differences(target_tok, draft_tok)
    checks = ("tokenizer type", "vocabulary size", "token texts", "special tokens", "chat template")
    return CompatReport(checks, tuple(warnings))


def _soft_differences(target_tok, draft_tok) -> list[str]:
    """Warnings for differences drafting survives: special token sets (their ids agree,
    checked before) and chat templates (prompts use the target's)."""
    warnings = []
    t_special = set(getattr(target_tok, "all_special_tokens", []) or [])
    d_special = set(getattr(draft_tok, "all_special_tokens", []) or [])
    if t_special != d_special:
        diff = sorted(t_special ^ d_special)[:4]
        warnings.append(f"special token sets differ ({', '.join(map(repr, diff))}); ids agree, so drafting works")
    if getattr(target_tok, "chat_template", None) != getattr(draft_tok, "chat_template", None):
        warnings.append("chat templates differ; prompts are formatted with the target's template")
    return warnings


def _check_texts(t_vocab: dict, d_vocab: dict, emit: int, family, warnings: list[str]) -> None:
    """Ids below `emit` (what the draft can propose) must mean the same text in both."""
    if t_vocab == d_vocab:  # one family's tokenizer (the usual pair): nothing differs
        return
    t_by_id = {i: t for t, i in t_vocab.items()}
    d_by_id = {i: t for t, i in d_vocab.items()}
    differ = sorted(i for i in set(t_by_id) | set(d_by_id) if t_by_id.get(i) != d_by_id.get(i))
    bad = [i for i in differ if i < emit]
    if bad:
        shown = ", ".join(f"id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}" for i in bad[:3])
        raise _fail(
            f"token text check failed: target and draft map tokens to different ids ({len(bad)} ids differ; {shown})",
            family,
        )
    if differ:
        warnings.append(
            f"the tokenizers differ on {len(differ)} ids from {differ[0]} on, which the "
            f"draft never proposes (it has {emit} ids in common with the target)"
        )


def _check_special_ids(target_tok, draft_tok, family) -> None:
    for attr in ("eos_token", "bos_token", "unk_token"):
        t_id, d_id = getattr(target_tok, f"{attr}_id", None), getattr(draft_tok, f"{attr}_id", None)
        if t_id != d_id:
            t_val, d_val = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
            raise _fail(
                f"special token check failed: {attr.removesuffix('_token')} is {t_val!r} (id "
                f"{t_id}) for the target but {d_val!r} (id {d_id}) for the draft",
                family,
            )


def config_vocab_size(checkpoint: Path) -> tuple[int | None, str | None]:
    """(vocab_size, model_type) from a checkpoint's config.json; Nones if unreadable."""
    try:
        raw = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    vocab = text.get("vocab_size")
    return (vocab if isinstance(vocab, int) else None), raw.get("model_type")


def embedding_rows(path: str | Path, backend: BackendName = BackendName.TORCH) -> int | None:
    """A checkpoint's embedding rows (config vocab_size) without reading weights; None for
    a backend that runs GGUF files as they are (known only once it has loaded them) or an
    unreadable config."""
    if BackendName(backend).runs_gguf:
        return None
    from ssdlocal.weights.formats.checkpoint import config_dir

    return config_vocab_size(config_dir(path))[0]  # a .gguf: its metadata directory only


def check_paths(target: str | Path, draft: str | Path) -> CompatReport:
    """check_pair on two checkpoints (dirs or .gguf files), reading no weights."""
    from ssdlocal.weights.formats.checkpoint import config_dir, load_tokenizer

    t_dir, d_dir = config_dir(target), config_dir(draft)
    t_vocab, family = config_vocab_size(t_dir)
    d_vocab, _ = config_vocab_size(d_dir)
    described = find(None, family) if family else None
    family = described.pair_family or family if described else family
    return check_pair(
        load_tokenizer(t_dir),
        load_tokenizer(d_dir),
        target_vocab=t_vocab,
        draft_vocab=d_vocab,
        family=family,
    )
