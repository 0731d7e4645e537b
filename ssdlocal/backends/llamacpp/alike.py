"""Batch-invariant decode steps on llama.cpp's CPU kernels (`--batch-invariant`).

llama.cpp's CPU kernels give a token logits that depend on how many tokens its call
holds. A call of one token keeps the attention query in float32 where wider calls round
it to float16; repacked weights switch from a matrix-vector to a matrix-matrix kernel at
four tokens, unrepacked K-quants to a tiled kernel at eight. Between such widths one
token's logits differ by tenths (up to 0.5 measured on Qwen2.5-Coder 1.5B Q4_K_M), so a
near-tie can go either way, and SD or SSD (verifying K+1 tokens in one call) can leave
greedy AR (one token per call). Between two widths of one kernel family a token's logits
are equal bit for bit, whatever else the call holds.

`plan_calls` puts the tokens of the rows that want logits for every token they feed
(decode steps, verification, tree branches) into calls of 2 to `width` tokens, a lone
token with a pad token of a scratch sequence beside it. Rows that want fewer (prompts)
are read in chunks as before, but for their last token when its logits are wanted: that
one goes with the steps, so the first answer token comes from the same kernels whether
the prompt was read whole or mostly taken from the prefix cache. `widest_alike` finds the widest such width on this machine
by decoding seven tokens at each candidate width and comparing their logits bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

WIDEST = 7  # unrepacked K-quants take a tiled kernel from 8 tokens on
REPACKED = 3  # repacked weights take a matrix-matrix kernel from 4 tokens on
_PREFIX = 8  # tokens the check reads before its seven
_PROBED = 7
_REFERENCE = (2, 2, 2, 1)  # widths the others are compared with
_PADDED = (1, 1, 1, 2, 2)  # lone tokens (padded) against pairs


@dataclass(frozen=True)
class Call:
    """One llama_decode: the batch indices it decodes; `pad`: a lone token, decoded beside
    a pad token of the scratch sequence."""

    index: list[int]
    pad: bool = False


def balanced(n: int, width: int) -> list[int]:
    """`n` tokens as the fewest calls of at most `width`, their sizes as even as they go."""
    calls = -(-n // width)
    return [n // calls + (1 if i < n % calls else 0) for i in range(calls)]


def plan_calls(seqs: Sequence[int], want: Sequence[bool], width: int, n_batch: int) -> list[Call]:
    """The calls for a batch whose token i belongs to sequence seqs[i] and wants its logits
    where want[i]: the tokens of sequences that want fewer logits than tokens (prompts) in
    chunks of `n_batch`, then the rest (steps, and a prompt's last token where wanted) in
    calls of 2 to `width` (one token alone: padded). A sequence's tokens keep their order."""
    reading = {s for s, w in zip(seqs, want) if not w}
    last = {s: i for i, s in enumerate(seqs)}  # each sequence's last token
    long = [i for i, s in enumerate(seqs) if s in reading and not (want[i] and last[s] == i)]
    short = [i for i, s in enumerate(seqs) if s not in reading or (want[i] and last[s] == i)]
    calls = [Call(long[i : i + n_batch]) for i in range(0, len(long), n_batch)]
    start = 0
    for size in balanced(len(short), width) if short else []:
        calls.append(Call(short[start : start + size], pad=size == 1))
        start += size
    return calls


Decode = Callable[[list[int], list[int], list[int], list[bool]], np.ndarray]
Remove = Callable[[int, int], None]


def beside_pad(
    decode: Decode,
    remove: Remove,
    pad_seq: int,
    tokens: list[int],
    positions: list[int],
    seqs: list[int],
    want: list[bool],
) -> np.ndarray:
    """`decode` of a lone token beside a pad token (its own, at position 0 of sequence
    `pad_seq`, no logits), whose cell is removed after the call."""
    try:
        return decode(tokens + tokens[:1], positions + [0], seqs + [pad_seq], want + [False])
    finally:
        remove(pad_seq, 0)


def widest_alike(decode: Decode, remove: Remove, guess: int, seq: int, pad_seq: int, vocab: int) -> int:
    """The widest width up to `guess` at which a token's logits equal those of calls of two
    (and a padded lone token's), or 0 where even a padded lone token's differ. `decode`
    (tokens, positions, seqs, want) -> logits of the wanted tokens; `remove(seq, p0)`
    drops sequence `seq`'s cells from position p0 on. Uses sequences `seq` and `pad_seq`
    and leaves both empty."""
    tokens = [(13 + 7 * i) % vocab for i in range(_PREFIX + _PROBED)]
    try:
        decode(tokens[:_PREFIX], list(range(_PREFIX)), [seq] * _PREFIX, [False] * _PREFIX)

        def logits(widths: Sequence[int]) -> np.ndarray:
            remove(seq, _PREFIX)
            out, pos = [], _PREFIX
            for n in widths:
                call = (tokens[pos : pos + n], list(range(pos, pos + n)), [seq] * n, [True] * n)
                out.append(beside_pad(decode, remove, pad_seq, *call) if n == 1 else decode(*call))
                pos += n
            return np.concatenate(out)

        reference = logits(_REFERENCE)
        if not np.array_equal(reference, logits(_PADDED)):
            return 0
        for width in range(min(guess, WIDEST), 2, -1):
            if np.array_equal(reference, logits(balanced(_PROBED, width))):
                return width
        return 2
    finally:
        remove(seq, 0)
        remove(pad_seq, 0)


def same_every_run(backend, device: str, batch_invariant: bool, *, drafted: bool, alone: bool) -> bool:
    """Whether a request's greedy tokens are the same whatever ran before or beside it, as
    far as the target's kernels go. Only llama.cpp's CPU kernels part with it: a row alone
    (no other request in its call or overlapping it) reading plainly is the same every run
    (its cells stay cells 0, 1, ...; it reuses only whole chunks of a cold read: prefix.py),
    and with `--batch-invariant` drafting is too; rows batched together interleave their
    cells and may round differently. Other backends keep each row's tokens its own."""
    from ssdlocal.core.models import BackendName

    if BackendName(backend) is not BackendName.LLAMACPP or device != "cpu":
        return True
    return alone and (batch_invariant or not drafted)
