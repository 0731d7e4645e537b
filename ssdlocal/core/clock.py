"""Seconds of a round's parts as the device spent them, read after the round's one host wait.

On a GPU the host only launches kernels: a host clock around the drafter measures its
launches, and one around the verify measures the draft's kernels still running plus the
verify's launches, so cost models fed host times would see drafting as nearly free. On
CUDA a `DeviceClock` records an event on the device's current stream at each mark, and
`seconds(a, b)` reads the elapsed time between two events once both have completed: the
caller asks only after the round's read-back, which waited for that stream already, so
timing adds no host wait. On the CPU (synchronous) it is the host's clock.
Knows no model, no round; torch is imported at first use.
"""

from __future__ import annotations

import time
from typing import Any


class DeviceClock:
    """Marks on one device's timeline: `mark()` now, `seconds(a, b)` between two marks."""

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        self.events = self.device.type == "cuda"

    def mark(self) -> Any:
        """A point in the device's work queue (an event on CUDA), or the host's time."""
        if not self.events:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks. On CUDA both must have completed (ask after a read of
        the same stream's later work), else this would wait: none does here."""
        if not self.events:
            return end - start
        if not end.query():  # asked too early (a caller bug): wait rather than fail
            end.synchronize()
        return start.elapsed_time(end) / 1e3
