"""StatsPanel: live speculation metrics of the current (or last) answer.

Reads the engine's metric snapshot (the metric names of docs/architecture.md §3: tokens_per_s, ttft_s,
prompt_tokens, cached_prompt_tokens, prefill_tokens_per_s, acceptance_rate, mean_accepted_len, cache_hit_rate, per_position_acceptance,
accepted_len_hist, draft_ms, verify_ms, backup_used) and draws numbers and bars.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.widgets import Static

from ssdlocal.tui.widgets.bars import hbar

BAR = 12


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _prompt(s: dict) -> str:
    """"2,162 tok, 2,144 cached · 95 tok/s": the prompt, what the prefix cache held, and how
    fast the rest was read."""
    total = s.get("prompt_tokens")
    if not total:
        return "–"
    text = f"{total:,} tok, {s.get('cached_prompt_tokens') or 0:,} cached"
    rate = s.get("prefill_tokens_per_s")
    return text + (f" · {rate:.0f} tok/s" if rate and total > (s.get("cached_prompt_tokens") or 0) else "")


class StatsPanel(Static):
    """Redrawn on every RoundFinished / GenerationDone message."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "stats--title",
        "stats--bar",
        "stats--hit",
        "stats--miss",
        "stats--draft",
        "stats--verify",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode = "ssd"
        self.snapshot: dict[str, Any] = {}
        self.last_backup: str | None = None
        self.last_hit: bool | None = None
        self.live = False

    def show_stats(
        self,
        mode: str,
        snapshot: dict[str, Any],
        *,
        backup: str | None = None,
        cache_hit: bool | None = None,
        live: bool = False,
    ) -> None:
        self.mode, self.snapshot, self.live = mode, snapshot, live
        if cache_hit is not None:
            self.last_hit = cache_hit
            self.last_backup = backup
        self.refresh_panel()

    def freeze(self) -> None:
        """The generation ended without a DoneEvent (an error): the numbers stop being live."""
        self.live = False
        self.refresh_panel()

    def reset(self, mode: str) -> None:
        self.mode, self.snapshot = mode, {}
        self.last_backup = self.last_hit = None
        self.refresh_panel()

    def on_mount(self) -> None:
        self.refresh_panel()

    def _style(self, name: str):
        return self.get_component_rich_style(f"stats--{name}", partial=True)

    def refresh_panel(self) -> None:
        s = self.snapshot
        out = Text()
        state = "live" if self.live else ("last answer" if s else "no answer yet")
        self._section(out, f"Speed · {self.mode.upper()} · {state}")
        self._row(out, "tokens/s", _num(s.get("tokens_per_s")))
        ttft = s.get("ttft_s")
        self._row(out, "TTFT", "–" if ttft is None else f"{ttft * 1e3:.0f} ms")
        self._row(out, "prompt", _prompt(s))
        rounds = s.get("rounds", 0)
        self._row(out, "tokens", f"{s.get('tokens', 0)} in {rounds} round{'s' * (rounds != 1)}" if s else "–")
        self._section(out, "Speculation")
        if self.mode == "ar":
            out.append("AR: the target alone,\none token per round\n", style="dim")
        else:
            self._speculation(out, s)
        self._time(out, s)
        out.rstrip()
        self.update(out)

    def _section(self, out: Text, name: str) -> None:
        out.append(("\n" if out else "") + name + "\n", style=self._style("title"))

    @staticmethod
    def _row(out: Text, label: str, value: str) -> None:
        out.append(f"{label:<13}{value}\n")

    def _speculation(self, out: Text, s: dict) -> None:
        row = lambda label, value: self._row(out, label, value)  # noqa: E731
        row("acceptance", _pct(s.get("acceptance_rate")))
        row("accepted len", _num(s.get("mean_accepted_len"), "{:.2f} tok/round"))
        if s.get("rows_by_source"):  # K and the source chosen per round
            row("K per round", _num(s.get("mean_k"), "{:.1f} on average"))
            sources = s["rows_by_source"]
            total = max(sum(sources.values()), 1)
            row("source", " ".join(f"{k} {v / total:.0%}" for k, v in sorted(sources.items())))
        if self.mode == "ssd":
            row("cache hits", _pct(s.get("cache_hit_rate")))
            used = s.get("backup_used") or {}
            row("backup fired", ", ".join(f"{k} ×{v}" for k, v in used.items()) or "none")
            if self.last_hit is not None:
                last = "hit" if self.last_hit else f"miss → {self.last_backup or 'none'}"
                out.append(f"{'last round':<13}")
                out.append(last + "\n", style=self._style("hit" if self.last_hit else "miss"))
        self._bars(out, "Acceptance by position", s.get("per_position_acceptance") or [], 1, _pct)
        hist = s.get("accepted_len_hist") or []
        total = max(hist, default=0)
        self._bars(out, "Accepted length", [c / total for c in hist] if total else [], 0,
                   lambda frac: f"{round(frac * total):>4}")  # fmt: skip

    def _bars(self, out: Text, title: str, fractions: list, first: int, label) -> None:
        self._section(out, title)
        if not fractions:
            out.append("–\n", style="dim")
        for i, frac in enumerate(fractions):
            out.append(f"{i + first:>2} ")
            out.append_text(hbar(frac, BAR, self._style("bar")))
            out.append(f" {label(frac):>4}\n")

    def _time(self, out: Text, s: dict) -> None:
        draft_ms, verify_ms = s.get("draft_ms"), s.get("verify_ms")
        self._section(out, "Time")
        if draft_ms is None or verify_ms is None:
            out.append("–\n", style="dim")
            return
        total_ms = max(draft_ms + verify_ms, 1e-9)
        for label, ms, style in (("draft", draft_ms, "draft"), ("verify", verify_ms, "verify")):
            out.append(f"{label:<7}")
            out.append_text(hbar(ms / total_ms, BAR - 3, self._style(style)))
            out.append(f" {ms:>6.0f} ms\n")
