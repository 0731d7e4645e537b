"""The server's counters and their Prometheus text exposition (GET /metrics).

Request counts by endpoint and outcome, prompt and generated tokens, speculation
counters (drafted / accepted tokens, row-rounds, SSD cache hits and misses, as vLLM
exposes its spec-decode counters) with the rates derived from them, draft / verify
time, and the last batch's tokens/s. Thread-safe: the engine thread records, the HTTP
side renders. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

from ssdlocal.core.metrics import Counts
from ssdlocal.core.metrics import Metrics as CallMetrics

PREFIX = "ssdlocal_"


class ServerMetrics:
    """Counters since the server started."""

    def __init__(self, model: str, mode: str, version: str) -> None:
        self.model, self.mode, self.version = model, mode, version
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.counts = Counts()  # core.stats counts of every answered request
        self.batches = 0
        self.draft_s = 0.0
        self.verify_s = 0.0
        self.last_tokens_per_s = math.nan
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.duration_sum = 0.0
        self.duration_count = 0
        self.prefill_s = 0.0  # engine calls' prompt reading
        self.read_prompt_tokens = 0  # prompt tokens read (not taken from the prefix cache)
        self.cached_prompt_tokens = 0  # prompt tokens taken from the prefix cache
        self.prefix_cache: dict = {}  # the target's prefix cache counts, as of the last call
        self.host_waits: dict[str, int] = defaultdict(int)  # per model: stream synchronisations (core.hostsync)
        self.batch_rounds = 0  # verification rounds of every engine call
        self.draft_losses = 0  # drafters that failed mid-batch (its rows went on without them)
        self.rows_running = 0  # rows of the running batch not finished yet
        self.rows_waiting = 0  # rows waiting to join it
        self.queue_sum = 0.0  # seconds from arrival to joining the running batch, summed over requests
        self.queue_count = 0

    # ------------------------------------------------------------------ recording
    def record_request(
        self, endpoint: str, status: str, prompt_tokens: int = 0, duration_s: float | None = None
    ) -> None:
        """One request answered: status ok | invalid | error | cancelled."""
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.prompt_tokens += prompt_tokens
            if duration_s is not None:
                self.duration_sum += duration_s
                self.duration_count += 1

    def record_tokens(self, n: int) -> None:
        """Tokens the engine just committed (for any row, cancelled ones included)."""
        with self._lock:
            self.generated_tokens += n

    def record_job(self, counts: Counts, stats: dict) -> None:
        """A job finished: its core.stats counts and its answer's stats
        (core.metrics.Metrics.request_stats: the JSON the client gets, whose ttft is the request's own)."""
        with self._lock:
            self.counts = self.counts + counts
            ttft = stats.get("ttft_s")
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_count += 1

    def set_rows(self, running: int, waiting: int) -> None:
        """Rows in the running batch (not finished) and rows waiting to join it."""
        with self._lock:
            self.rows_running, self.rows_waiting = running, waiting

    def record_queue(self, seconds: float) -> None:
        """A request's first row joined the running batch `seconds` after it arrived."""
        with self._lock:
            self.queue_sum += seconds
            self.queue_count += 1

    def record_batch(self, stats: CallMetrics, wall_s: float) -> None:
        """One batch (a seating of the serving loop: its rows between two re-seats) ended:
        its metrics."""
        with self._lock:
            self.batches += 1
            self.draft_s += stats.draft_ms / 1e3
            self.verify_s += stats.verify_ms / 1e3
            if stats.tokens_per_s is not None:
                self.last_tokens_per_s = stats.tokens_per_s
            self.prefill_s += stats.prefill_ms / 1e3
            self.cached_prompt_tokens += stats.cached_prompt_tokens
            self.read_prompt_tokens += stats.prompt_tokens - stats.cached_prompt_tokens
            self.prefix_cache = (stats.prefix_cache or {}).get("target", self.prefix_cache)
            self.batch_rounds += stats.rounds
            self.draft_losses += stats.draft_losses
            for model, waits in (stats.host_waits or {}).items():
                self.host_waits[model] += waits.get("waits", 0)

    # ------------------------------------------------------------------ exposition
    def render(self, running: int, waiting: int) -> str:
        """Prometheus text format (version 0.0.4)."""
        with self._lock:
            lines: list[str] = []

            def family(name: str, kind: str, help_text: str, samples) -> None:
                lines.append(f"# HELP {PREFIX}{name} {help_text}")
                lines.append(f"# TYPE {PREFIX}{name} {kind}")
                for suffix, labels, value in samples:
                    lines.append(f"{PREFIX}{name}{suffix}{_labels(labels)} {_number(value)}")

            def one(name: str, kind: str, help_text: str, value) -> None:
                family(name, kind, help_text, [("_total" if kind == "counter" else "", {}, value)])

            def summary(name: str, help_text: str, total: float, count: int) -> None:
                family(name, "summary", help_text, [("_sum", {}, total), ("_count", {}, count)])

            family(
                "info",
                "gauge",
                "The served model and decoding mode.",
                [("", {"model": self.model, "mode": self.mode, "version": self.version}, 1)],
            )
            family(
                "requests",
                "counter",
                "Requests answered, by endpoint and status (ok, invalid, error, cancelled).",
                [("_total", {"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
            )
            one("requests_running", "gauge", "Requests in the running batch.", running)
            one("requests_waiting", "gauge", "Requests waiting for the engine.", waiting)
            one("rows_running", "gauge", "Rows (choices) of the running batch not finished yet.", self.rows_running)
            one("rows_waiting", "gauge", "Rows (choices) waiting to join the running batch.", self.rows_waiting)
            summary(
                "queue_time_seconds",
                "From arrival to the request's first row joining the batch.",
                self.queue_sum,
                self.queue_count,
            )
            one("prompt_tokens", "counter", "Prompt tokens of answered requests.", self.prompt_tokens)
            one(
                "generation_tokens",
                "counter",
                "Tokens the engine generated (rows cancelled mid-way included).",
                self.generated_tokens,
            )
            one(
                "batches",
                "counter",
                "Batches run: seatings of the serving loop (rows between two re-seats).",
                self.batches,
            )
            one(
                "tokens_per_second",
                "gauge",
                "Decode tokens/s of the last batch (all its rows).",
                self.last_tokens_per_s,
            )
            c, m = self.counts, CallMetrics.of(self.counts)
            one("spec_decode_draft_tokens", "counter", "Draft tokens proposed.", c.drafted)
            one("spec_decode_accepted_tokens", "counter", "Draft tokens accepted.", c.accepted)
            one("spec_decode_row_rounds", "counter", "Verifications of one row (row-rounds).", c.row_rounds)
            one(
                "spec_decode_emitted_tokens",
                "counter",
                "Tokens committed by decode rounds (accepted drafts + bonus).",
                c.emitted,
            )
            one(
                "ssd_cache_hits",
                "counter",
                "SSD row-rounds served from the speculation cache.",
                c.ssd.rows_hit if c.ssd else 0,
            )
            one("ssd_cache_misses", "counter", "SSD row-rounds that missed the cache.", c.ssd.rows_miss if c.ssd else 0)
            one("acceptance_rate", "gauge", "Accepted / drafted tokens since start.", _nan(m.acceptance_rate))
            one("mean_accepted_len", "gauge", "Tokens per row-round since start.", _nan(m.mean_accepted_len))
            one("cache_hit_rate", "gauge", "SSD cache hits / SSD row-rounds since start.", _nan(m.cache_hit_rate))
            one("prefill_seconds", "counter", "Time spent reading prompts (engine calls).", self.prefill_s)
            one(
                "prefill_tokens",
                "counter",
                "Prompt tokens read by the target (not from the prefix cache).",
                self.read_prompt_tokens,
            )
            one(
                "prefix_cache_hit_tokens",
                "counter",
                "Prompt tokens taken from the prefix cache.",
                self.cached_prompt_tokens,
            )
            pc = self.prefix_cache
            one(
                "prefix_cache_used_tokens", "gauge", "Tokens the target's prefix cache holds.", pc.get("used_tokens", 0)
            )
            one(
                "prefix_cache_capacity_tokens",
                "gauge",
                "The target's prefix cache size in tokens.",
                pc.get("capacity_tokens", 0),
            )
            family(
                "host_waits",
                "counter",
                "Device -> host reads and blocking host -> device copies (stream synchronisations on a GPU), by model.",
                [("_total", {"model": k}, n) for k, n in sorted(self.host_waits.items())],
            )
            family(
                "host_waits_per_round",
                "gauge",
                "Host waits per verification round since start, by model.",
                [
                    ("", {"model": k}, n / self.batch_rounds if self.batch_rounds else math.nan)
                    for k, n in sorted(self.host_waits.items())
                ],
            )
            one(
                "draft_losses",
                "counter",
                "Drafters (an SSD worker, a draft model) that failed mid-batch; its rows finished without them.",
                self.draft_losses,
            )
            one("draft_seconds", "counter", "Time spent drafting (waiting for proposals).", self.draft_s)
            one("verify_seconds", "counter", "Time spent in target verification.", self.verify_s)
            summary("time_to_first_token_seconds", "From arrival to the first token.", self.ttft_sum, self.ttft_count)
            summary(
                "request_duration_seconds", "From arrival to the answer's end.", self.duration_sum, self.duration_count
            )
            return "\n".join(lines) + "\n"


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"
