"""The chat at 80x24: every line on screen, the stats panel without a scrollbar (detail
dropped first), the header's three lines within 80 columns with the weights' real format,
how to quit on screen, the mode's whole reason behind F7, loading progress in the status
line, and a change of mode mid-answer said on screen."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("textual")

from support.fake_engine import FakeEngine, chat_settings
from support.tui import asynctest, settle

from ssdlocal.core.config import Mode
from ssdlocal.placement.mode import placement_mode
from ssdlocal.tui.app import ChatApp
from ssdlocal.tui.screens.dialogs import WhyModal
from ssdlocal.tui.widgets.header import PairHeader
from ssdlocal.tui.widgets.stats_panel import StatsPanel

SMALL = (80, 24)


def _app(engine, load=None, **settings):
    chat = chat_settings(draft=engine.config.spec.draft, max_new_tokens=settings.pop("max_new_tokens", 48), **settings)
    return ChatApp(load or (lambda: engine), engine.config, chat)


def _screen_text(app) -> list[str]:
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


async def _answer(pilot, text="What is SSD?"):
    await settle(pilot)
    await pilot.press(*text, "enter")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause(0.1)


@asynctest
async def test_the_chat_fits_80x24_and_says_how_to_quit():
    engine = FakeEngine()
    engine.choice = placement_mode(("cpu",), "cpu", "model")
    app = _app(engine)
    async with app.run_test(size=SMALL) as pilot:
        await _answer(pilot)
        lines = _screen_text(app)
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        text = "\n".join(lines)
        assert "^q Quit" in lines[-1] and "Ctrl+Q quits" in text  # footer and input box
        assert lines[2].startswith(" " + engine.choice.line)  # the header's mode line, whole
        panel = app.screen.query_one(StatsPanel)
        side = panel.parent
        assert panel.virtual_size.height <= side.size.height, (panel.virtual_size, side.size)
        assert side.max_scroll_y == 0  # nothing below the fold
        assert "Time" in text and "TTFT" in text and "prompt" in text  # kept; a prefill row is reserved
        assert any(line.split("│")[0].rstrip().endswith("max 48 · ready") for line in lines), text  # one line


def test_the_status_settings_have_a_compact_form():
    settings = chat_settings(mode=Mode.SD, draft="d", max_new_tokens=None)
    settings = settings.with_spec(adaptive_k=True, k=12)
    assert settings.describe() == "SD · K≤12 per round · T=0 · max to EOS"
    assert settings.describe(compact=True) == "SD K≤12 T=0 to EOS"


@asynctest
async def test_a_taller_terminal_shows_the_detail_too():
    app = _app(FakeEngine())
    async with app.run_test(size=(100, 45)) as pilot:
        await _answer(pilot)
        text = "\n".join(_screen_text(app))
        assert "Acceptance by position" in text and "Accepted length" in text and "Time" in text
        assert app.screen.query_one(StatsPanel).parent.max_scroll_y == 0


@asynctest
async def test_f7_shows_the_whole_reason_and_the_weights():
    engine = FakeEngine()
    engine.choice = placement_mode(("cpu",), "cpu", "model")
    app = _app(engine)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("f7")
        await pilot.pause()
        assert isinstance(app.screen, WhyModal)
        text = "\n".join(body for _, body in app.screen.rows)
        assert engine.choice.reason in text  # the whole reason, not the header's short one
        assert "fp32 from tiny-target" in text


@asynctest
async def test_the_status_line_shows_loading_progress():
    from ssdlocal.core.progress import report

    engine, go = FakeEngine(), threading.Event()

    def load():
        report("loading tiny-target (int4)", 500, 1000)
        go.wait(10)
        return engine

    app = _app(engine, load=load)
    async with app.run_test(size=SMALL) as pilot:
        for _ in range(100):
            await pilot.pause(0.02)
            if "loading tiny-target (int4): 50%" in "\n".join(_screen_text(app)):
                break
        else:
            pytest.fail("\n".join(_screen_text(app)))
        go.set()
        await settle(pilot)


@asynctest
async def test_a_change_of_mode_mid_answer_is_said_on_screen():
    engine = FakeEngine()
    engine.mode_event_at = 1
    app = _app(engine, mode=Mode.SD)
    async with app.run_test(size=SMALL) as pilot:
        await _answer(pilot)
        header = app.screen.query_one(PairHeader)
        assert "mode ar: switched from SD (fake)" in str(header.render())
        assert app.screen._gen_mode is Mode.AR


@asynctest
async def test_the_why_dialog_starts_at_its_title_on_a_small_terminal():
    from ssdlocal.engine.auto import Calibration, calibrated_choice

    engine = FakeEngine()
    engine.choice = calibrated_choice(Calibration(12, 0.335, 1.299, 0.175), adaptive_k=True)
    app = _app(engine)
    async with app.run_test(size=(80, 16)) as pilot:  # shorter than the dialog
        await settle(pilot)
        await pilot.press("f7")
        await pilot.pause()
        await pilot.pause(0.1)
        text = "\n".join(_screen_text(app))
        assert "What runs where, and why" in text, text
