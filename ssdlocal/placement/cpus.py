"""CPU placement for SSD on CPU-only machines: disjoint cores for target and draft.

`split_cpus` is pure over the list of usable CPUs; `CpuPlan.apply_to_this_process`
pins the target (this process) and returns a handle that restores the old setting.
Affinity is set on every thread of the process: Linux pins single threads, and torch's
OpenMP workers created while pinned would otherwise stay on the target's cores after
a restore (an AR run after an SSD run then crawled on one core with two threads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuPlan:
    target_cpus: tuple[int, ...]
    draft_cpus: tuple[int, ...]

    @property
    def target_threads(self) -> int:
        return len(self.target_cpus)

    @property
    def draft_threads(self) -> int:
        return len(self.draft_cpus)

    def apply_to_this_process(self, pin_affinity: bool = True) -> _Restore:
        """Use the target's thread count here (and its cores when `pin_affinity`)."""
        import torch

        can_pin = pin_affinity and hasattr(os, "sched_getaffinity")
        old_cpus = tuple(sorted(os.sched_getaffinity(0))) if can_pin else None
        old_threads = torch.get_num_threads()
        if old_cpus is not None:
            set_process_affinity(self.target_cpus)
        torch.set_num_threads(self.target_threads)
        return _Restore(old_cpus, old_threads)


@dataclass(frozen=True)
class _Restore:
    cpus: tuple[int, ...] | None
    threads: int

    def restore(self) -> None:
        import torch

        if self.cpus is not None:
            set_process_affinity(self.cpus)
        torch.set_num_threads(self.threads)


def set_process_affinity(cpus) -> None:
    """Pin every thread of this process (not just the caller) to `cpus`."""
    wanted = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread is the best we can do
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:  # thread exited meanwhile
            pass


def usable_cpus() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cpus(cpus: tuple[int, ...] | None = None, draft_share: float = 1 / 3) -> CpuPlan | None:
    """Give the draft about a third of the cores (at least one), the target the rest.

    Returns None with fewer than 2 CPUs (both processes then share the one core).
    """
    cpus = usable_cpus() if cpus is None else tuple(cpus)
    if len(cpus) < 2:
        return None
    n_draft = max(1, int(len(cpus) * draft_share))
    return CpuPlan(target_cpus=cpus[:-n_draft], draft_cpus=cpus[-n_draft:])
