"""Choosing SSD's backup speculator for missed rows (pure; docs/architecture.md §1, 'Fallback').

With batch size b all rows hit with probability h^b; one miss stalls the batch for the
backup's latency. Below a critical batch size the neural backup (jit draft) pays off,
above it a fast one (n-gram) does. The chooser estimates h, the jit latency and the
tokens per round of each path online and picks the higher expected throughput.
"""

from __future__ import annotations

from ssdlocal.core.config import Backup


def expected_rate(
    batch: int, hit_rate: float, tokens_hit: float, tokens_miss: float, verify_s: float, backup_s: float
) -> float:
    """Expected tokens per second for `batch` rows (all rows wait for the slowest)."""
    p_all_hit = hit_rate**batch
    tokens = batch * (hit_rate * tokens_hit + (1 - hit_rate) * tokens_miss)
    seconds = verify_s + (1 - p_all_hit) * backup_s
    return tokens / seconds if seconds > 0 else 0.0


class BackupChooser:
    """Online choice between Backup.JIT and Backup.NGRAM when the user asked for AUTO; any
    other policy is returned as it is."""

    def __init__(self, policy: Backup, k: int) -> None:
        self.policy = Backup(policy)
        self.k = k
        self.hits = 1.0  # pseudo-counts, prior hit rate 0.5
        self.rows = 2.0
        self.tokens_hit = 1.0 + 0.7 * k  # prior tokens/round on a hit
        self.tokens_jit = 1.0 + 0.7 * k
        self.tokens_ngram = 1.2
        self.tokens_suffix = 1.2
        self.jit_s: float | None = None
        self.last = Backup.JIT

    def observe_proposal(self, msg) -> None:
        """Learn from a ProposalMsg: hit flags and how long a jit backup took."""
        n = len(msg.cache_hit)
        if n:
            self.hits += sum(msg.cache_hit)
            self.rows += n
        if msg.backup == Backup.JIT:
            busy = max(0.0, msg.busy_s - msg.prespec_s)
            self.jit_s = busy if self.jit_s is None else 0.8 * self.jit_s + 0.2 * busy

    def observe_tokens(self, served_by: Backup | None, tokens: float) -> None:
        """Exponential averages of tokens per round of a row whose drafts came from the
        cache (`served_by` None) or from that backup (JIT, NGRAM, SUFFIX; others: ignored)."""
        name = _TOKENS_OF.get(served_by)
        if name is not None:
            setattr(self, name, 0.9 * getattr(self, name) + 0.1 * tokens)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows

    def choose(self, batch: int, verify_s: float) -> Backup:
        if self.policy is not Backup.AUTO:
            return self.policy
        if batch <= 0 or self.jit_s is None:
            self.last = Backup.JIT
            return Backup.JIT
        h = self.hit_rate
        jit = expected_rate(batch, h, self.tokens_hit, self.tokens_jit, verify_s, self.jit_s)
        fast = expected_rate(batch, h, self.tokens_hit, self.tokens_ngram, verify_s, 0.0)
        self.last = Backup.JIT if jit >= fast else Backup.NGRAM
        return self.last


_TOKENS_OF = {
    None: "tokens_hit",
    Backup.JIT: "tokens_jit",
    Backup.NGRAM: "tokens_ngram",
    Backup.SUFFIX: "tokens_suffix",
}
