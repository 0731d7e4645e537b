"""What a seating's stats report beyond its events: each model's captured steps, prefix caches
and host waits (core.stats.StatsSources), taken from the target's runner, the seating's
drafter and the engine's draft side, and frozen when the seating ends."""

from __future__ import annotations

from ssdlocal.backends.base import Runner
from ssdlocal.core.hostsync import Audit, WaitsSince
from ssdlocal.draft.base import Drafter
from ssdlocal.engine.drafts import DraftSide


def graph_reports(target: Runner, drafter: Drafter | None, since: dict | None = None) -> dict[str, dict]:
    """Captured-step counts per model ("target"; "draft": the drafter's model, here or in the
    SSD worker), minus `since` (the reports at the seating's start)."""
    since = since or {}
    reports = {"target": target.graph_report(since.get("target"))}
    draft = drafter.graph_report(since.get("draft")) if drafter is not None else None
    if draft is not None:
        reports["draft"] = draft
    return reports


def prefix_reports(target: Runner, drafts: DraftSide) -> dict[str, dict]:
    """The prefix caches' sizes and counts per model ("target"; "draft": the draft model
    here, or the SSD worker's as of its latest batch start)."""
    out = {}
    for name, report in (("target", target.prefix_report()), ("draft", drafts.prefix_report())):
        if report is not None:
            out[name] = report
    return out


class SeatingReports:
    """core.stats.StatsSources of one seating, counted from its start; `freeze` (at its end)
    keeps the graph and host-wait counts as they are then."""

    def __init__(self, target: Runner, drafter: Drafter | None, drafts: DraftSide, audit: Audit) -> None:
        self.target, self.drafter, self.drafts = target, drafter, drafts
        self.graphs_before = graph_reports(target, drafter)
        self.waits = WaitsSince(audit, drafter.host_waits if drafter is not None else None)  # SSD: + the worker's
        self._graphs: dict[str, dict] | None = None

    def graphs(self) -> dict[str, dict]:
        if self._graphs is not None:
            return self._graphs
        return graph_reports(self.target, self.drafter, self.graphs_before)

    def prefix(self) -> dict[str, dict]:
        return prefix_reports(self.target, self.drafts)

    def host_waits(self) -> dict:
        return self.waits()

    def freeze(self) -> None:
        self._graphs = self.graphs()
        self.waits.freeze()
