"""SVG snapshot tests (pytest-textual-snapshot) of the chat, race and error screens.

Driven by the scripted FakeEngine with a virtual clock, so every number on screen is
deterministic. Update after an intended UI change with `pytest --snapshot-update`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from support.fake_engine import FakeEngine, FakeMeter, chat_settings

from ssdlocal.core.config import SamplingParams
from ssdlocal.core.errors import OutOfMemoryError
from ssdlocal.tui.app import ChatApp, RaceApp
from ssdlocal.tui.race import race_specs

SIZE = (120, 36)


def _chat(engine: FakeEngine) -> ChatApp:
    from ssdlocal.placement.mode import placement_mode

    engine.choice = placement_mode(("cpu",), "cpu", "model")  # auto's: SD, K per round (the chat runs SSD)
    settings = chat_settings(draft=engine.config.spec.draft, max_new_tokens=48)
    return ChatApp(lambda: engine, engine.config, settings, meter=FakeMeter())


async def _loaded(pilot) -> None:
    for _ in range(500):  # the loading thread is not a Textual worker
        if not pilot.app.loading:
            break
        await pilot.pause(0.01)
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def _ask(pilot, text: str) -> None:
    await _loaded(pilot)
    await pilot.press(*text, "enter")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_chat_screen(snap_compare):
    async def run_before(pilot):
        await _ask(pilot, "What is SSD?")

    assert snap_compare(_chat(FakeEngine()), run_before=run_before, terminal_size=SIZE)


def test_chat_screen_80x24(snap_compare):
    """The smallest common terminal: nothing wraps or scrolls (tests/test_tui_fit.py)."""

    async def run_before(pilot):
        await _ask(pilot, "What is SSD?")

    assert snap_compare(_chat(FakeEngine()), run_before=run_before, terminal_size=(80, 24))


def test_chat_error_modal(snap_compare):
    engine = FakeEngine(
        fail_after=1,
        error=OutOfMemoryError(
            "out of memory running the target on cuda:0",
            "use fewer prompts, a smaller --max-new-tokens, --dtype bfloat16, or another device",
        ),
    )

    async def run_before(pilot):
        await _ask(pilot, "hi")

    assert snap_compare(_chat(engine), run_before=run_before, terminal_size=SIZE)


def test_race_screen(snap_compare, monkeypatch):
    from ssdlocal.tui import facts

    monkeypatch.setattr(facts, "_cores", lambda: 2)  # the SSD pane names the cores: the same on every machine
    engine = FakeEngine()
    app = RaceApp(
        lambda: engine,
        engine.config,
        "Explain speculative decoding in one paragraph.",
        race_specs(engine.config.spec),
        SamplingParams(max_new_tokens=60),
        clock=engine.clock,
        meter=FakeMeter(others=(0.0, 0.0, 1.2, 1.1)),  # SSD disturbed twice: re-run once, still marked
    )

    async def run_before(pilot):
        for _ in range(200):
            await pilot.app.workers.wait_for_complete()
            await pilot.pause(0.01)
            if all(r is not None for r in pilot.app.screen.runs):
                break
        await pilot.press("s")  # skip the replay to its end
        await pilot.pause()

    assert snap_compare(app, run_before=run_before, terminal_size=SIZE)
