"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and completions'
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token is shown as its own text (a byte-level BPE token's bytes decoded, `bytes` exact);
where a token holds part of a character, `token` has the replacement character and `bytes`
the real bytes. Pure building of dicts from core.events.TokenLogprob.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._lookup(token)
        return found

    def _lookup(self, token: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token])
        return text, list(text.encode("utf-8"))


def chat_entries(logprobs, text_of: TokenText) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` for these tokens."""
    out = []
    for lp in logprobs:
        token, raw = text_of(lp.token)
        top = []
        for alt, value in lp.top:
            alt_text, alt_raw = text_of(alt)
            top.append({"token": alt_text, "logprob": value, "bytes": alt_raw})
        out.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_block(logprobs, text_of: TokenText, offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` for these tokens; `offset`: characters before them."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        token, _ = text_of(lp.token)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        values.append(lp.logprob)
        tops.append({text_of(alt)[0]: value for alt, value in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
