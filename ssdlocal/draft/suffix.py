"""The suffix source: proposals from the row's own tokens and the engine's memory of earlier
prompts and answers (speculation/suffix.py), and the file that memory may persist in.

`SuffixSource` keeps one index per row, grown from each round's outcome (never a copy of
the rows to diff). The memory belongs to the engine, which adds every finished row
(prompt + answer) to it: it outlives generate calls (server requests, chat turns) and is
never shared between engines, so it never crosses models. `MemoryFile` stores it
under the cache directory, keyed by the target model, written atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ssdlocal.draft.base import RoundOutcome, RowView
from ssdlocal.speculation.suffix import SuffixIndex, SuffixMemory, SuffixProposal, propose

log = logging.getLogger(__name__)


class SuffixSource:
    """Per-row suffix indexes over one batch, plus the engine's shared memory."""

    def __init__(self, memory: SuffixMemory | None, min_confidence: float = 0.3) -> None:
        self.memory = memory
        self.min_confidence = min_confidence
        self.rows: Sequence[RowView] = ()
        self.own: list[SuffixIndex] = []

    def start(self, rows: Sequence[RowView]) -> None:
        self.rows = rows
        self.own = [SuffixIndex(row.tokens) for row in rows]

    def proposals(self, active: Sequence[bool], k: int) -> list[SuffixProposal]:
        """Up to k tokens per active row (empty proposals for the others)."""
        memory = self.memory.indexes() if self.memory is not None else []
        return [
            propose(own.tokens, own, memory, k, self.min_confidence) if on else SuffixProposal((), ())
            for own, on in zip(self.own, active)
        ]

    def observe(self, outcome: RoundOutcome) -> None:
        for own, appended in zip(self.own, outcome.appended):
            own.extend(appended)

    def close(self) -> None:
        """The batch is over (the engine hands its rows to the memory)."""
        self.own = []


class MemoryFile:
    """A SuffixMemory persisted as JSON under `directory`, one file per target model.

    Loading trusts nothing: a file that is not a regular file, cannot be parsed, or holds
    entries that are not lists of token ids of this vocabulary loses those entries, with
    one warning naming the file. Saving never fails the call: a write that fails (a full
    disk) is one warning, and its temporary file is removed."""

    def __init__(self, directory: Path, model_key: str, vocab_size: int) -> None:
        digest = hashlib.sha256(model_key.encode()).hexdigest()[:16]
        self.path = Path(directory) / f"{digest}.json"
        self.model_key = model_key
        self.vocab_size = vocab_size
        self._save_failed = False

    def load(self, memory: SuffixMemory) -> None:
        """Fill `memory` from the file; a missing, damaged or foreign file is ignored."""
        from ssdlocal.core.files import kind_of

        if (kind := kind_of(self.path)) is not None:  # a FIFO would block the read
            log.warning("ignoring suffix memory %s: it is %s, not a file", self.path, kind)
            return
        limit = 16 * (memory.max_tokens + memory.max_sequences) + (1 << 20)  # ids are short numbers
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(limit + 1)
            if len(raw) > limit:
                raise ValueError(f"over {limit:,} bytes")
            data = json.loads(raw)
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("ignoring suffix memory %s: unreadable (%s)", self.path, str(exc)[:100] or type(exc).__name__)
            return
        if not isinstance(data, dict) or data.get("model") != self.model_key:
            log.warning("ignoring suffix memory %s: written for another model or damaged", self.path)
            return
        sequences = data.get("sequences")
        sequences = sequences if isinstance(sequences, list) else [sequences]
        dropped = 0
        for seq in sequences:
            if isinstance(seq, list) and all(type(t) is int and 0 <= t < self.vocab_size for t in seq):
                memory.add(seq)
            else:
                dropped += 1
        if dropped:
            log.warning(
                "suffix memory %s: dropped %d of %d entries that are not token ids of this model (0..%d)",
                self.path,
                dropped,
                len(sequences),
                self.vocab_size - 1,
            )

    def save(self, memory: SuffixMemory) -> None:
        """Write the memory (bounded by its caps) atomically: never half a file. A failure
        is a warning (once per file), never an error: the answer it follows is not lost."""
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as fh:
                fh.write(json.dumps({"model": self.model_key, "sequences": memory.sequences()}))
            os.replace(tmp, self.path)
            self._save_failed = False
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._save_failed:
                log.warning(
                    "could not save the suffix memory to %s: %s (answers are not affected; "
                    "free some disk space, or drop --persist-suffix-memory)",
                    self.path,
                    exc.strerror or exc,
                )
            self._save_failed = True


def open_memory(settings, target_path: str, vocab_size: int) -> tuple[SuffixMemory, MemoryFile | None]:
    """The engine's memory for `settings` (core.models.MemorySettings), loaded from its file
    when `settings.persist`; the file (or None) to save it to after each call."""
    from ssdlocal.core.paths import cache_dir

    memory = SuffixMemory(settings.max_sequences, settings.max_tokens)
    if not settings.persist:
        return memory, None
    key = f"{Path(target_path).expanduser().resolve()}|vocab={vocab_size}"
    file = MemoryFile(cache_dir() / "suffix", key, vocab_size)
    file.load(memory)
    return memory, file
