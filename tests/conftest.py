"""Shared pytest setup: makes tests/ importable (helpers live in the `support` package), builds
the tiny checkpoints once, and shares the fixtures of support/fixtures.py with every module."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Captured steps that read tensors their owner did not declare static, or a static tensor
# rebound after capture, fail loudly in tests (in use they only warn and run eagerly).
# Set before anything starts a draft worker or rank, which inherit it.
os.environ.setdefault("SSDLOCAL_GRAPHS_STRICT", "1")
# Every test measures at its own start: no test reads timings an earlier test (or an earlier
# run) kept, and nothing is written to the user's cache. test_measured.py turns it back on.
os.environ.setdefault("SSDLOCAL_KEEP_MEASUREMENTS", "0")
# No test builds llama-cpp-python (a first CPU run's step); test_kernels.py fakes the build.
os.environ.setdefault("SSDLOCAL_BUILD_LLAMACPP", "0")

from support.fixtures import fake_asset, hub, pip_calls, tiny_gguf  # noqa: E402,F401 - shared fixtures


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints sharing one tokenizer: llama, qwen2, qwen3, llama3_rope,
    draft_llama / draft_qwen2 (noisy copies of the targets), small_llama (1 layer)."""
    from support.tiny_models import make_tiny_suite

    return make_tiny_suite(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread in a module and in the processes it spawns (draft workers and
    tensor-parallel ranks read OMP_NUM_THREADS at start): tiny models gain nothing from
    threads, and on a busy 2-core machine a parallel region waiting on a descheduled
    thread stalls for long. Use with `pytestmark = pytest.mark.usefixtures(...)`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _sigint_restored(request):
    """Every test starts with Python's Ctrl-C handler: a test (or code it runs in-process)
    that leaves SIGINT ignored or replaced would make later tests' child processes ignore
    Ctrl-C (a child inherits an ignored signal) and `_thread.interrupt_main` do nothing.
    The handler is put back, with a warning naming the test after which it was found
    changed (by that test, or by what ran before it in the same worker process)."""
    import signal
    import warnings

    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        found = signal.getsignal(signal.SIGINT)
        warnings.warn(
            f"SIGINT handled by {found!r} after {request.node.nodeid}; Python's handler put back", stacklevel=1
        )
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _DraftFailures(logging.Handler):
    """Keeps the engine's "the drafter failed" warnings of one test."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())


@pytest.fixture(autouse=True)
def _no_silent_draft_loss(request):
    """A draft that fails hands its rows to plain steps, which give AR's tokens: a test that
    compares tokens would pass without its mode having run. So a draft failure fails every
    test not marked `draft_loss` (the tests that make a draft fail on purpose)."""
    handler = _DraftFailures()
    logger = logging.getLogger("ssdlocal.engine.round")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.reasons and request.node.get_closest_marker("draft_loss") is None:
        pytest.fail(f"a draft failed and its rows went on with plain steps: {handler.reasons[0]}")
