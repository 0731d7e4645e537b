"""TUI tests against the scripted FakeEngine: pilot-driven chat and race, plus the UI-free core.

No model is loaded here; tests/test_tui_e2e.py runs the chat on a tiny checkpoint.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("textual")

from support.tui import asynctest, settle
from support.fake_engine import WORDS, FakeEngine, chat_settings, fake_config

from ssdlocal.core.config import Mode, SamplingParams
from ssdlocal.core.errors import DraftWorkerError, ModelLoadError, UsageError
from ssdlocal.tui.app import ChatApp, RaceApp
from ssdlocal.tui.core import Conversation, OriginSplitter, run_command
from ssdlocal.tui.race import RaceRun, race_specs, record_run, summarize
from ssdlocal.tui.screens.chat import ChatScreen
from ssdlocal.tui.screens.dialogs import ErrorModal
from ssdlocal.tui.widgets.stats_panel import StatsPanel
from ssdlocal.tui.widgets.transcript import AnswerText

SIZE = (120, 36)


def chat_app(engine: FakeEngine, **settings) -> ChatApp:
    settings.setdefault("max_new_tokens", 40)
    chat = chat_settings(draft=engine.config.spec.draft, **settings)
    return ChatApp(lambda: engine, engine.config, chat)


async def ready(pilot) -> ChatScreen:
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, ChatScreen) and screen.engine is not None
    return screen


async def say(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def finish(pilot) -> None:
    await settle(pilot)


# --------------------------------------------------------------------------- chat
@asynctest
async def test_chat_streams_an_answer_and_keeps_the_history():
    engine = FakeEngine()
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await say(pilot, "hello there")
        await finish(pilot)
        answers = list(screen.query(AnswerText))
        assert len(answers) == 1
        expected = " ".join(WORDS[:40]) + " "
        assert answers[0].text == expected == screen.last_answer
        assert "SSD · 40 tokens" in answers[0].note and "max tokens reached" in answers[0].note
        origins = {o for _, o in answers[0].pieces}
        assert origins == {"draft_hit", "draft", "target"}
        stats = screen.query_one(StatsPanel).snapshot
        assert stats["tokens"] == 40 and stats["cache_hit_rate"] is not None
        # the prompt went through the chat template over the whole history
        ids, params, spec = engine.calls[0]
        assert ids == [Conversation().prompt_ids(engine.tokenizer, "hello there")]
        assert spec.mode is Mode.SSD and spec.k == 4 and params.max_new_tokens == 40
        # second turn: the history (with the first answer) is part of the prompt
        await say(pilot, "and then?")
        await finish(pilot)
        conv = Conversation(
            messages=[
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": expected},
            ]
        )
        assert engine.calls[1][0] == [conv.prompt_ids(engine.tokenizer, "and then?")]
        assert len(screen.conversation.messages) == 4


@asynctest
async def test_the_status_line_shows_the_prompt_being_read():
    import threading

    engine = FakeEngine()
    engine.prefill_gate = threading.Event()
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await say(pilot, "hello there")
        total = None
        for _ in range(200):
            await pilot.pause(0.02)
            status = str(screen.query_one("#status").render())
            if "reading the prompt" in status:
                total = status
                break
        assert total is not None
        ids = engine.calls[0][0][0]
        assert f"reading the prompt {len(ids) // 2:,} / {len(ids):,}" in total
        engine.prefill_gate.set()
        await finish(pilot)
        assert "reading the prompt" not in str(screen.query_one("#status").render())
        panel = str(screen.query_one(StatsPanel).render())
        assert f"{len(ids):,} · 0 cached" in panel


@asynctest
async def test_message_typed_while_loading_is_sent_after_load():
    import threading

    gate = threading.Event()
    engine = FakeEngine()

    def slow_load():
        gate.wait(5)
        return engine

    app = ChatApp(slow_load, engine.config, chat_settings(draft="d", max_new_tokens=10))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await say(pilot, "early")
        assert not engine.calls
        gate.set()
        await finish(pilot)
        await finish(pilot)
        assert len(engine.calls) == 1 and app.screen.last_answer


@asynctest
async def test_stop_mid_generation_and_engine_stays_usable():
    engine = FakeEngine(hold_after=3)
    app = chat_app(engine, max_new_tokens=len(WORDS))
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await say(pilot, "long answer please")
        for _ in range(200):
            await pilot.pause(0.02)
            if screen.query(AnswerText) and len(screen.query_one(AnswerText).text.split()) > 5:
                break
        assert screen.generating
        await pilot.press("escape")
        await finish(pilot)
        answer = screen.query_one(AnswerText)
        assert engine.calls and not screen.generating
        assert "stopped" in answer.note
        assert 0 < len(answer.text.split()) < len(WORDS)
        assert screen.conversation.messages[-1]["content"] == answer.text  # partial answer kept
        engine.hold_after = None
        await say(pilot, "again")
        await finish(pilot)
        assert "max tokens reached" in list(screen.query(AnswerText))[-1].note


@asynctest
async def test_keys_and_commands_change_mode_k_temperature():
    engine = FakeEngine()
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await pilot.press("f2")  # SSD -> AR
        assert screen.settings.mode is Mode.AR
        await pilot.press("f2")
        assert screen.settings.mode is Mode.SD
        await pilot.press("f4", "f4", "f3")
        assert screen.settings.k == 5
        await pilot.press("f6", "f6")
        assert screen.settings.temperature == pytest.approx(0.2)
        await say(pilot, "/temp 0.7")
        await say(pilot, "/mode ssd")
        await say(pilot, "/fanout 2,2,2,1,1,1")
        await say(pilot, "/k abc")  # bad input: a warning, settings unchanged
        assert screen.settings.k == 5 and screen.settings.spec.fan_out == (2, 2, 2, 1, 1, 1)
        await say(pilot, "hi")
        await finish(pilot)
        _, params, spec = engine.calls[-1]
        assert spec.mode is Mode.SSD and spec.k == 5 and spec.fan_out == (2, 2, 2, 1, 1, 1)
        assert params.temperature == pytest.approx(0.7)
        await pilot.press("f3")  # K=4: the fan-out no longer fits and falls back to auto
        assert screen.settings.k == 4 and screen.settings.spec.fan_out is None
        assert "K=4" in str(screen.query_one("#status").content)


@asynctest
async def test_ar_only_engine_refuses_other_modes():
    engine = FakeEngine(fake_config(Mode.AR, draft=None))
    app = ChatApp(lambda: engine, engine.config, chat_settings(mode=Mode.AR, draft=None, max_new_tokens=5))
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await pilot.press("f2")
        await say(pilot, "/mode ssd")
        assert screen.settings.mode is Mode.AR


@asynctest
async def test_copy_clear_colours_and_help():
    engine = FakeEngine()
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await say(pilot, "hi")
        await finish(pilot)
        await pilot.press("ctrl+y")
        assert app.clipboard == screen.last_answer != ""
        await pilot.press("f8")
        assert not screen.query_one(AnswerText).show_colors
        await say(pilot, "/colors")
        assert screen.query_one(AnswerText).show_colors
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert not screen.query(AnswerText) and screen.conversation.messages == []
        await pilot.press("f1")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpModal"
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen


@asynctest
async def test_generation_error_shows_modal_and_recovers():
    engine = FakeEngine(
        fail_after=2,
        error=DraftWorkerError("the draft worker died (exit code -9)", "it is restarted on the next request"),
    )
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await say(pilot, "hi")
        await finish(pilot)
        assert isinstance(app.screen, ErrorModal)
        assert "draft worker died" in app.screen.message and "restarted" in app.screen.hint
        assert "failed" in screen.query_one(AnswerText).note and not screen.generating
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is screen
        engine.fail_after = None
        await say(pilot, "again")
        await finish(pilot)
        assert screen.last_answer


@asynctest
async def test_unexpected_error_and_load_failure_show_modals():
    def broken():
        raise ModelLoadError("cannot read /nope/model.safetensors", "check the --target path")

    app = ChatApp(broken, fake_config(), chat_settings(draft="d"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, ErrorModal)
        assert app.screen.hint == "check the --target path"
    engine = FakeEngine(fail_after=0, error=RuntimeError("CUDA out of memory. Tried to allocate"))
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hi")
        await finish(pilot)
        assert isinstance(app.screen, ErrorModal) and app.screen.message.startswith("out of memory")


# --------------------------------------------------------------------------- race
def race_app(engine: FakeEngine, **kw) -> RaceApp:
    return RaceApp(
        lambda: engine,
        engine.config,
        "Explain speculative decoding.",
        race_specs(engine.config.spec),
        SamplingParams(max_new_tokens=30),
        clock=engine.clock,
        **kw,
    )


@asynctest
async def test_race_records_three_modes_and_replays_to_a_summary():
    engine = FakeEngine()
    app = race_app(engine, speed=50.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        for _ in range(100):
            await pilot.pause(0.02)
            if app.screen.finished:
                break
        screen = app.screen
        assert screen.finished
        assert [c[2].mode for c in engine.calls] == [
            Mode.AR,
            Mode.SD,
            Mode.SSD,
        ] * 2  # warm-up + runs
        assert all(c[1].max_new_tokens == 4 for c in engine.calls[:3])
        assert "identical output in every mode" in screen.verdict
        assert [r.mode for r in screen.rows] == ["AR", "SD", "SSD"]
        assert "replayed side by side with measured timings" in str(screen.query_one("#race-note").content)
        texts = {p.body.text for p in screen.panes}
        assert len(texts) == 1 and texts.pop().split() == WORDS[:30]
        screen.speed = 1e-3  # replay slowly: it must restart from nothing
        await pilot.press("r")
        assert not screen.finished and all(p.body.text == "" for p in screen.panes)
        await pilot.press("s")
        assert screen.finished


@asynctest
async def test_race_failure_shows_modal():
    engine = FakeEngine(fail_after=1)
    app = race_app(engine, warmup=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, ErrorModal)


# --------------------------------------------------------------------------- UI-free core
def test_commands_and_settings():
    s = chat_settings(draft="d")
    assert run_command("/mode ar", s).settings.mode is Mode.AR
    assert run_command("/stop", s).action == "stop"
    assert run_command("/max 12", s).settings.max_new_tokens == 12
    for bad in ("/mode xx", "/k 0", "/fanout 1,2", "/fanout a", "/temp -1", "/nope", "/seed x"):
        with pytest.raises(UsageError) as info:
            run_command(bad, s)
        assert info.value.hint
    with pytest.raises(UsageError):
        chat_settings(mode=Mode.SSD, draft=None)
    with pytest.raises(UsageError, match="at most 32"):
        chat_settings(draft="d", k=33)
    k3 = s.with_k(3)
    assert k3.k == 3 and k3.spec.fan_out is None and k3.spec.draft.model.path == "d"
    spec = run_command("/fanout 1,1,1,1", k3).settings.spec
    assert spec.k == 3 and spec.fan_out == (1, 1, 1, 1)
    assert run_command("/k 4", run_command("/fanout 1,1,1,1", k3).settings).settings.spec.fan_out is None


def test_origin_splitter_follows_token_boundaries():
    engine = FakeEngine()
    tok = engine.tokenizer
    splitter = OriginSplitter(tok)
    ids = tok.encode("draft model checks")
    pieces = splitter.split(ids, ("draft_hit", "draft_hit", "target"), tok.decode(ids))
    assert pieces == [("draft model ", "draft_hit"), ("checks ", "target")]
    more = tok.encode("target")
    assert splitter.split(more, ("target",), tok.decode(more)) == [("target ", "target")]
    # a held-back delta (empty text) yields no pieces
    assert splitter.split(more, ("draft",), "") == []


def test_race_timeline_and_summary():
    engine = FakeEngine()
    ids = engine.encode("hi", chat=True)
    runs = [
        record_run(engine, ids, SamplingParams(max_new_tokens=20), s, clock=engine.clock)
        for s in race_specs(engine.config.spec)
    ]
    ar = runs[0]
    assert ar.tokens == 20 and ar.shown(0.0) == 0 and ar.shown(ar.times[-1]) == len(ar.times)
    assert ar.rate_at(ar.times[-1]) == pytest.approx(ar.stats["tokens_per_s"])
    rows = summarize(runs)
    assert rows[0].speedup == 1.0 and rows[2].speedup > 1 and rows[2].identical is True
    assert RaceRun(Mode.AR).rate_at(1.0) is None


def test_engine_and_cli_do_not_import_textual():
    code = (
        "import sys, ssdlocal.cli, ssdlocal.cli.tui, ssdlocal.tui, ssdlocal.tui.core, "
        "ssdlocal.tui.race; "
        "assert 'textual' not in sys.modules, 'textual imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_textual_gives_install_hint(monkeypatch):
    import builtins

    from ssdlocal.core.errors import SSDLocalError
    from ssdlocal.tui import require_textual

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "textual":
            raise ImportError("no textual")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(SSDLocalError) as info:
        require_textual()
    assert "ssdlocal[tui]" in info.value.hint


@asynctest
async def test_chat_forgets_the_oldest_turns_when_the_context_is_full():
    engine = FakeEngine(context=160)  # a few turns of ~40-token answers fill it
    app = chat_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        for i in range(6):
            await say(pilot, f"question {i} about the draft model")
            await finish(pilot)
            assert not isinstance(app.screen, ErrorModal), app.screen.message
        assert len(engine.calls) == 6 and screen.turn == 6
        budget = engine.max_prompt_tokens(40)
        assert all(len(ids[0]) <= budget for ids, _, _ in engine.calls)
        assert len(screen.conversation.messages) < 2 * 6  # the oldest turns were forgotten


# --------------------------------------------------------------------------- stop and quit
@asynctest
async def test_esc_before_the_generation_has_started_stops_it():
    import threading

    engine = FakeEngine()
    app = chat_app(engine, max_new_tokens=len(WORDS))
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        engine.gate = threading.Event()  # the worker thread is slow to reach generate
        await say(pilot, "long answer please")
        await pilot.press("escape")
        engine.gate.set()
        await finish(pilot)
        answer = screen.query_one(AnswerText)
        assert "stopped" in answer.note and len(answer.text.split()) < len(WORDS)


@asynctest
async def test_quitting_the_race_stops_the_remaining_modes():
    import time

    engine = FakeEngine(hold_after=2)  # the first warm-up run is surely mid-way at quit
    app = race_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        for _ in range(200):
            await pilot.pause(0.02)
            if engine.calls:
                break
        t0 = time.monotonic()
        await pilot.press("q")
    assert time.monotonic() - t0 < 5
    assert len(engine.calls) == 1  # none of the other five runs started


def test_quit_while_the_models_load_returns_at_once_and_closes_them_later():
    import asyncio
    import threading
    import time

    gate = threading.Event()
    engine = FakeEngine()

    def slow_load():
        gate.wait(20)
        return engine

    app = RaceApp(slow_load, engine.config, "hi", race_specs(engine.config.spec), SamplingParams(max_new_tokens=5))

    async def quit_at_once():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("q")

    t0 = time.monotonic()
    asyncio.run(quit_at_once())  # asyncio waits for executor threads (Textual's workers) here
    assert time.monotonic() - t0 < 5, "quit waited for the load"
    assert app.release_engine() is None and not engine.closed  # still loading
    gate.set()
    for _ in range(200):
        if engine.closed:
            break
        time.sleep(0.02)
    assert engine.closed and not engine.calls  # closed on arrival, never used
