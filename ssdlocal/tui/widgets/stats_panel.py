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
    """"2,162 · 2,144 cached": the prompt's tokens and what the prefix cache held (one line
    of the panel, whose value column is 20 characters)."""
    total = s.get("prompt_tokens")
    if not total:
        return "–"
    return f"{total:,} · {s.get('cached_prompt_tokens') or 0:,} cached"


def _prefill(s: dict) -> str:
    """"95 tok/s": how fast the part of the prompt the cache did not hold was read."""
    rate, total = s.get("prefill_tokens_per_s"), s.get("prompt_tokens") or 0
    return f"{rate:.0f} tok/s" if rate and total > (s.get("cached_prompt_tokens") or 0) else "–"


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

    def on_resize(self) -> None:
        self.refresh_panel()

    def _style(self, name: str):
        return self.get_component_rich_style(f"stats--{name}", partial=True)

    def _height(self) -> int:
        """Rows the panel may fill without scrolling (its container's height)."""
        parent = self.parent
        height = getattr(getattr(parent, "size", None), "height", 0) or getattr(self.size, "height", 0)
        return height if height > 0 else 10_000

    def refresh_panel(self) -> None:
        """Draw the sections that fit: detail goes first (the accepted-length histogram,
        then per-position acceptance, then the time split, then SSD's last-round detail),
        so the panel never scrolls, down to an 80x24 terminal."""
        s = self.snapshot
        sections = [self._speed(s), self._speculation_rows(s)]
        optional = [  # (drop order: last first) -> kept while they fit
            self._time(s),
            self._bars("Acceptance by position", s.get("per_position_acceptance") or [], 1, _pct)
            if self.mode != "ar" else None,
            self._histogram(s) if self.mode != "ar" else None,
        ]
        budget = self._height()
        used = sum(len(sec) for sec in sections) + len(sections) - 1  # a blank line between
        for extra in optional:
            if extra is None:
                continue
            if used + 1 + len(extra) > budget:
                break
            sections.append(extra)
            used += 1 + len(extra)
        out = Text()
        for n, section in enumerate(sections):
            if n:
                out.append("\n")
            for line in section:
                out.append_text(line)
                out.append("\n")
        out.rstrip()
        self.update(out)

    def _title(self, name: str) -> Text:
        return Text(name, style=self._style("title"))

    @staticmethod
    def _row(label: str, value: str, style: str = "") -> Text:
        return Text.assemble(f"{label:<13}", (value, style))

    def _speed(self, s: dict) -> list[Text]:
        state = "live" if self.live else ("last answer" if s else "no answer yet")
        rows = [self._title(f"Speed · {self.mode.upper()} · {state}"),
                self._row("tokens/s", _num(s.get("tokens_per_s")))]  # fmt: skip
        ttft = s.get("ttft_s")
        rows.append(self._row("TTFT", "–" if ttft is None else f"{ttft * 1e3:.0f} ms"))
        rows.append(self._row("prompt", _prompt(s)))  # its tokens and what the prefix cache held
        rows.append(self._row("prefill", _prefill(s)))  # how fast the rest was read
        rounds = s.get("rounds", 0)
        rows.append(self._row("tokens", f"{s.get('tokens', 0)} in {rounds} round{'s' * (rounds != 1)}" if s else "–"))
        return rows

    def _speculation_rows(self, s: dict) -> list[Text]:
        rows = [self._title("Speculation")]
        if self.mode == "ar":
            return rows + [Text("AR: the target alone,", style="dim"), Text("one token per round", style="dim")]
        rows.append(self._row("acceptance", _pct(s.get("acceptance_rate"))))
        rows.append(self._row("accepted len", _num(s.get("mean_accepted_len"), "{:.2f} tok/round")))
        sources = s.get("rows_by_source")
        if sources:  # K and the source chosen per round; "none": a plain step
            total = max(sum(sources.values()), 1)
            plain = sources.get("none", 0) / total
            rows.append(self._row("K per round", _num(s.get("mean_k"), "{:.1f}") + f" · plain {plain:.0%}"))
            shown = [f"{k} {v / total:.0%}" for k, v in sorted(sources.items()) if k != "none"]
            rows.append(self._row("source", " ".join(shown) or "–"))
        if self.mode == "ssd":
            rows.append(self._row("cache hits", _pct(s.get("cache_hit_rate"))))
            used = s.get("backup_used") or {}
            rows.append(self._row("backup fired", ", ".join(f"{k} ×{v}" for k, v in used.items()) or "none"))
            if self.last_hit is not None:
                last = "hit" if self.last_hit else f"miss → {self.last_backup or 'none'}"
                rows.append(self._row("last round", last, self._style("hit" if self.last_hit else "miss")))
        return rows

    def _histogram(self, s: dict) -> list[Text]:
        hist = s.get("accepted_len_hist") or []
        total = max(hist, default=0)
        return self._bars("Accepted length", [c / total for c in hist] if total else [], 0,
                          lambda frac: f"{round(frac * total):>4}")  # fmt: skip

    def _bars(self, title: str, fractions: list, first: int, label) -> list[Text]:
        rows = [self._title(title)]
        if not fractions:
            rows.append(Text("–", style="dim"))
        for i, frac in enumerate(fractions):
            rows.append(Text.assemble(f"{i + first:>2} ", hbar(frac, BAR, self._style("bar")), f" {label(frac):>4}"))
        return rows

    def _time(self, s: dict) -> list[Text]:
        draft_ms, verify_ms = s.get("draft_ms"), s.get("verify_ms")
        rows = [self._title("Time")]
        if draft_ms is None or verify_ms is None:
            return rows + [Text("–", style="dim")]
        total_ms = max(draft_ms + verify_ms, 1e-9)
        for label, ms, style in (("draft", draft_ms, "draft"), ("verify", verify_ms, "verify")):
            rows.append(Text.assemble(f"{label:<7}", hbar(ms / total_ms, BAR - 3, self._style(style)), f" {ms:>6.0f} ms"))
        return rows
