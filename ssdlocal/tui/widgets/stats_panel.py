"""StatsPanel: live speculation metrics of the current (or last) answer.

Reads the engine's metrics (core.metrics.Metrics: speed, ttft, the prompt and its prefill,
acceptance, accepted length, per-position acceptance and the accepted-length histogram,
draft / verify time, and the adaptive and SSD parts) and draws numbers and bars; and says
what stands behind them: the other load on the CPU while the answer ran (tui/load.py: its
timings are not this hardware's own when others used a share of it), where the draft runs,
and why the answer runs its mode (tui/facts.answer_reason).
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from ssdlocal.core.config import Mode
from ssdlocal.core.metrics import Metrics
from ssdlocal.tui.load import Disturbance
from ssdlocal.tui.widgets.bars import hbar

BAR = 12


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _prompt(s: Metrics) -> str:
    """ "2,162 · 2,144 cached": the prompt's tokens and what the prefix cache held (one line
    of the panel, whose value column is 20 characters)."""
    if not s.prompt_tokens:
        return "–"
    return f"{s.prompt_tokens:,} · {s.cached_prompt_tokens:,} cached"


def _load(load: Disturbance | None, live: bool) -> str:
    """ "0.9 of 2 cores ⚠": other processes' CPU while the answer ran."""
    if live:
        return "measuring…"
    if load is None or load.others_cores is None:
        return "–" if load is None else "unknown"
    return f"{load.others_cores:.1f} of {load.cores} cores" + (" ⚠" if load.disturbed else "")


def _prefill(s: Metrics) -> str:
    """ "95 tok/s": how fast the part of the prompt the cache did not hold was read."""
    rate = s.prefill_tokens_per_s
    return f"{rate:.0f} tok/s" if rate and s.prompt_tokens > s.cached_prompt_tokens else "–"


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
        self.mode = Mode.SSD
        self.snapshot: Metrics | None = None  # None: no answer yet
        self.last_backup: str | None = None
        self.last_hit: bool | None = None
        self.live = False
        self.load: Disturbance | None = None  # other load while the last answer ran
        self.reason = ""  # why the answer runs its mode
        self.place = ""  # where the draft runs, in short

    def show_context(self, reason: str, place: str) -> None:
        """Why the mode runs and where the draft runs (the chat says it on every change)."""
        self.reason, self.place = reason, place
        self.refresh_panel()

    def show_stats(
        self,
        mode: Mode,
        snapshot: Metrics,
        *,
        backup: str | None = None,
        cache_hit: bool | None = None,
        live: bool = False,
        load: Disturbance | None = None,
    ) -> None:
        self.mode, self.snapshot, self.live = mode, snapshot, live
        if not live:
            self.load = load
        if cache_hit is not None:
            self.last_hit = cache_hit
            self.last_backup = backup
        self.refresh_panel()

    def freeze(self) -> None:
        """The generation ended without a DoneEvent (an error): the numbers stop being live."""
        self.live = False
        self.refresh_panel()

    def reset(self, mode: Mode) -> None:
        self.mode, self.snapshot, self.load = mode, None, None
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
        s = self.snapshot or Metrics()  # no answer yet: every number unknown
        sections = [self._speed(s), self._speculation_rows(s)]
        optional = [  # (drop order: last first) -> kept while they fit
            self._time(s),
            self._why() if self.reason else None,
            self._bars("Acceptance by position", list(s.per_position_acceptance), 1, _pct)
            if self.mode is not Mode.AR
            else None,
            self._histogram(s) if self.mode is not Mode.AR else None,
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

    def _speed(self, s: Metrics) -> list[Text]:
        answered = self.snapshot is not None
        state = "live" if self.live else ("last answer" if answered else "no answer yet")
        rows = [self._title(f"Speed · {self.mode.upper()} · {state}"), self._row("tokens/s", _num(s.tokens_per_s))]
        rows.append(self._row("TTFT", "–" if s.ttft_s is None else f"{s.ttft_s * 1e3:.0f} ms"))
        rows.append(self._row("prompt", _prompt(s)))  # its tokens and what the prefix cache held
        rows.append(self._row("prefill", _prefill(s)))  # how fast the rest was read
        rounds = s.rounds
        rows.append(self._row("tokens", f"{s.tokens} in {rounds} round{'s' * (rounds != 1)}" if answered else "–"))
        busy = self.load is not None and self.load.disturbed
        rows.append(self._row("other CPU", _load(self.load, self.live), self._style("miss") if busy else ""))
        return rows

    def _why(self) -> list[Text]:
        """The mode's reason, wrapped to the panel (its whole story is behind F7)."""
        import textwrap

        width = max((self.size.width or 34) - 2, 20)
        return [self._title("Why")] + [Text(line, style="dim") for line in textwrap.wrap(self.reason, width)]

    def _speculation_rows(self, s: Metrics) -> list[Text]:
        rows = [self._title("Speculation")]
        if self.mode is Mode.AR:
            return rows + [Text("AR: the target alone,", style="dim"), Text("one token per round", style="dim")]
        if self.place:
            rows.append(self._row("draft", self.place))
        rows.append(self._row("acceptance", _pct(s.acceptance_rate)))
        rows.append(self._row("accepted len", _num(s.mean_accepted_len, "{:.2f} tok/round")))
        sources = s.adaptive.rows_by_source if s.adaptive else None
        if sources:  # K and the source chosen per round; "none": a plain step
            total = max(sum(sources.values()), 1)
            plain = sources.get("none", 0) / total
            rows.append(self._row("K per round", _num(s.mean_k, "{:.1f}") + f" · plain {plain:.0%}"))
            shown = [f"{k} {v / total:.0%}" for k, v in sorted(sources.items()) if k != "none"]
            rows.append(self._row("source", " ".join(shown) or "–"))
        if self.mode is Mode.SSD:
            rows.append(self._row("cache hits", _pct(s.cache_hit_rate)))
            used = s.ssd.backup_used if s.ssd else {}
            rows.append(self._row("backup fired", ", ".join(f"{k} ×{v}" for k, v in used.items()) or "none"))
            if self.last_hit is not None:
                last = "hit" if self.last_hit else f"miss → {self.last_backup or 'none'}"
                rows.append(self._row("last round", last, self._style("hit" if self.last_hit else "miss")))
        return rows

    def _histogram(self, s: Metrics) -> list[Text]:
        hist = list(s.accepted_len_hist)
        total = max(hist, default=0)
        return self._bars(
            "Accepted length", [c / total for c in hist] if total else [], 0, lambda frac: f"{round(frac * total):>4}"
        )

    def _bars(self, title: str, fractions: list, first: int, label) -> list[Text]:
        rows = [self._title(title)]
        if not fractions:
            rows.append(Text("–", style="dim"))
        for i, frac in enumerate(fractions):
            rows.append(Text.assemble(f"{i + first:>2} ", hbar(frac, BAR, self._style("bar")), f" {label(frac):>4}"))
        return rows

    def _time(self, s: Metrics) -> list[Text]:
        draft_ms, verify_ms = s.draft_ms, s.verify_ms
        rows = [self._title("Time")]
        if self.snapshot is None:
            return rows + [Text("–", style="dim")]
        total_ms = max(draft_ms + verify_ms, 1e-9)
        for label, ms, style in (("draft", draft_ms, "draft"), ("verify", verify_ms, "verify")):
            rows.append(
                Text.assemble(f"{label:<7}", hbar(ms / total_ms, BAR - 3, self._style(style)), f" {ms:>6.0f} ms")
            )
        return rows
