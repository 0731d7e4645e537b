"""Tensor-parallel ranks with a fault injected in their own process (spawned: patches made in
the test's process do not reach them), for tests/test_tp.py. Each is a drop-in for
parallel/rank.rank_main that RankGroup spawns when a test puts it in its place."""

from __future__ import annotations


def rank_main_failing_capture(*args) -> None:
    """A rank whose every capture fails after it traced (its collectives met rank 0's, as a
    CUDA graph's capture records them without running them): rank 0 must run those shapes
    eagerly on every rank instead of losing the group."""
    from ssdlocal.backends.torch import capture
    from ssdlocal.parallel.rank import rank_main

    traced = capture.TracedGraphs.capture

    def failing(self, fn, inputs):
        traced(self, fn, inputs)
        raise capture.CaptureError("injected: this rank's capture failed")

    capture.TracedGraphs.capture = failing
    rank_main(*args)
