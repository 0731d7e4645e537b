"""End to end: the chat TUI on a tiny real checkpoint (SSD with a draft worker process).

The answer shown in the TUI must be token-for-token the target's greedy (AR) answer.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

from ssdlocal.core.config import (
    EngineConfig,
    Mode,
    ModelSpec,
    SamplingParams,
    SpecConfig,
)
from support.drafts import draft_of
from ssdlocal.core.config import ModelDraft


@pytest.fixture()
def one_torch_thread():
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's threads and ours would oversubscribe 2 cores
    yield
    torch.set_num_threads(old)


def test_chat_on_tiny_checkpoint_matches_ar(tiny_dir, one_torch_thread):
    from ssdlocal.cli.tui import prepare_subprocesses
    from ssdlocal.engine import Engine
    from ssdlocal.tui.app import ChatApp
    from ssdlocal.tui.core import ChatSettings, Conversation
    from ssdlocal.tui.screens.chat import ChatScreen

    draft = str(tiny_dir["draft_llama"])
    config = EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), "cpu", "float32"),
        spec=SpecConfig(mode=Mode.SSD, k=4, draft=ModelDraft(ModelSpec(draft, "cpu", "float32"))),
        pin_cpus=False,
    )
    settings = ChatSettings(SpecConfig(mode=Mode.SSD, k=4, draft=draft_of(draft)), SamplingParams(max_new_tokens=24))
    prepare_subprocesses()
    app = ChatApp(lambda: Engine(config), config, settings)

    async def drive():
        async with app.run_test(size=(120, 36)) as pilot:
            for _ in range(600):  # loading: target here, draft in its worker process
                await pilot.pause(0.05)
                if app.engine is not None:
                    break
            screen = app.screen
            assert isinstance(screen, ChatScreen) and screen.engine is not None
            await pilot.press(*"hello world", "enter")
            await app.workers.wait_for_complete()
            await pilot.pause()
            return screen.last_answer, screen.query_one("StatsPanel").snapshot

    try:
        answer, stats = asyncio.run(drive())
        engine = app.loaded_engine
        assert engine is not None
        ids = Conversation().prompt_ids(engine.tokenizer, "hello world")
        params = SamplingParams(max_new_tokens=24)
        ar = [e for e in engine.generate([ids], params, spec=SpecConfig(mode=Mode.AR))][-1]
        assert answer == ar.outputs[0].text
        assert stats["tokens"] == len(ar.outputs[0].token_ids)
        assert stats.get("cache_hit_rate") is not None  # it really ran SSD
    finally:
        if app.loaded_engine is not None:
            app.loaded_engine.close()
