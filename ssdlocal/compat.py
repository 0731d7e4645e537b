"""Target/draft compatibility: can the draft's tokens be verified by the target?

Works on tokenizers only (no weights), so it runs before any model is loaded.
Padded embedding rows (e.g. Qwen's 151936 vs 152064) are tolerated: only the
tokenizer's real tokens must agree.
"""

from __future__ import annotations

from .errors import IncompatiblePairError

_HINT = (
    "use a draft from the same model family that shares the target's tokenizer "
    "(e.g. Qwen2.5-Coder-1.5B + Qwen2.5-Coder-0.5B), or --draft ngram"
)


def check_pair(target_tok, draft_tok) -> None:
    """Raise IncompatiblePairError naming the first check that fails."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(t_vocab) != len(d_vocab):
        raise IncompatiblePairError(
            f"vocabulary size check failed: target tokenizer has {len(t_vocab)} tokens, "
            f"draft has {len(d_vocab)}",
            _HINT,
        )
    if t_vocab != d_vocab:
        diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:3]
        shown = ", ".join(f"{tok!r}->{idx}" for tok, idx in diff)
        raise IncompatiblePairError(
            f"token text check failed: target and draft map tokens to different ids ({shown})",
            _HINT,
        )
    if getattr(target_tok, "eos_token", None) != getattr(draft_tok, "eos_token", None):
        raise IncompatiblePairError(
            f"special token check failed: eos is {target_tok.eos_token!r} for the target but "
            f"{draft_tok.eos_token!r} for the draft",
            _HINT,
        )
