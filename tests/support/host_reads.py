"""Counting tensor -> Python reads in tests: each is a host wait on a GPU."""

from __future__ import annotations

import torch


class HostReads:
    """Counts tensor -> Python reads (item, tolist, int/float/bool/index of a tensor) while active."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.active = False
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                if self.active:
                    self.count += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
