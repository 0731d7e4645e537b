"""The race and the chat say what stands behind their numbers (pilot-driven, FakeEngine,
scripted machine load): a run disturbed by other load is re-run or marked, the SSD pane says
where its draft runs and what it would give on hardware of its own, the footer says what
`auto` picks here, and the chat's stats panel says the other load of each answer, where the
draft runs and why the answer runs its mode."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from support.fake_engine import FakeEngine, FakeMeter, chat_settings
from support.tui import asynctest, settle

from ssdlocal.core.config import Mode, SamplingParams
from ssdlocal.placement.mode import placement_mode
from ssdlocal.tui.app import ChatApp, RaceApp
from ssdlocal.tui.race import race_specs
from ssdlocal.tui.widgets.race_pane import RacePane
from ssdlocal.tui.widgets.stats_panel import StatsPanel
from ssdlocal.tui.widgets.transcript import AnswerText

SIZE = (120, 40)


def _panel_text(app) -> str:
    return str(app.screen.query_one(StatsPanel).render())


@asynctest
async def test_the_chat_panel_says_other_load_where_the_draft_runs_and_why():
    engine = FakeEngine()
    engine.choice = placement_mode(("cpu",), "cpu", "model")  # auto: SD with K per round
    settings = chat_settings(mode=Mode.SD, draft=engine.config.spec.draft, max_new_tokens=30)
    app = ChatApp(lambda: engine, engine.config, settings, meter=FakeMeter(others=(1.2, 0.0)))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        panel = app.screen.query_one(StatsPanel)
        assert panel.reason == f"auto: {engine.choice.short}" and panel.place == "shares the CPU"
        await pilot.press(*"hello", "enter")
        await settle(pilot)
        text = _panel_text(app)
        assert "other CPU    1.2 of 2 cores ⚠" in text and "draft        shares the CPU" in text
        assert "Why" in text and "K chosen per round" in text
        note = app.screen.query(AnswerText).last().note
        assert "timings disturbed (other processes used 1.2 of 2 cores)" in note
        await pilot.press("f2")  # SD -> SSD: a mode picked in the chat, beside auto's
        assert panel.reason.startswith("SSD picked in the chat (F2, /mode); auto picks SD")
        await pilot.press(*"again", "enter")
        await settle(pilot)
        assert "other CPU    0.0 of 2 cores" in _panel_text(app) and "⚠" not in _panel_text(app)


@asynctest
async def test_a_switch_mid_answer_is_the_panels_reason():
    engine = FakeEngine()
    engine.mode_event_at = 1
    settings = chat_settings(mode=Mode.SD, draft=engine.config.spec.draft, max_new_tokens=30)
    app = ChatApp(lambda: engine, engine.config, settings, meter=FakeMeter())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press(*"hello", "enter")
        await settle(pilot)
        assert app.screen.query_one(StatsPanel).reason == "the engine switched to AR: switched from SD (fake)"


@asynctest
async def test_the_race_reruns_a_disturbed_mode_and_says_what_auto_picks(monkeypatch):
    from ssdlocal.tui import facts

    monkeypatch.setattr(facts, "_cores", lambda: 2)
    engine = FakeEngine()
    app = RaceApp(
        lambda: engine,
        engine.config,
        "Explain speculative decoding.",
        race_specs(engine.config.spec),
        SamplingParams(max_new_tokens=30),
        clock=engine.clock,
        meter=FakeMeter(others=(1.5,)),  # AR's first run shares the CPU; every other run is calm
    )
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(300):
            await pilot.pause(0.02)
            if all(r is not None for r in app.screen.runs):
                break
        await pilot.press("s")
        screen = app.screen
        assert [c[2].mode for c in engine.calls[3:]] == [Mode.AR, Mode.AR, Mode.SD, Mode.SSD]  # after the warm-up
        footer = "\n".join(screen.footer)
        assert "same: identical output in every mode ✓" in footer
        assert "timings: AR ran again: its first run shared the CPU (other processes used 1.5 of 2 cores)" in footer
        assert "auto here: a calibration of the loaded models at start picks AR or SD" in footer
        ssd = next(p for p in screen.query(RacePane) if p.mode == "ssd")
        assert ssd.note.startswith("draft shares the target's 2 CPU cores; own hardware: ")
        assert "× AR projected (bench --project, draft/target 0.12)" in ssd.note
