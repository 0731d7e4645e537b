"""Driving Textual apps in tests without an async plugin: `asynctest` runs an async test
with asyncio.run, `settle` waits for the app's loading thread and workers."""

from __future__ import annotations


def asynctest(fn):
    """Run an async test with asyncio.run (no pytest async plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))

    return wrapper


async def settle(pilot) -> None:
    """Wait for the loading thread (not a Textual worker), then for the workers."""
    for _ in range(500):
        if not getattr(pilot.app, "loading", False):
            break
        await pilot.pause(0.01)
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
