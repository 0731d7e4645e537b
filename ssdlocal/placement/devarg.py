"""Device-list arguments: `cuda:0-3`, `cuda:0,cuda:2`, `cuda:0-1,cuda:4`, `cpu*2` / `cpu,cpu`.

Pure string handling (no torch); `format_devices` writes a plan's devices back in the
short form, so `ssdlocal devices` can print the flags that reproduce its plan.
"""

from __future__ import annotations

import re

from ssdlocal.core.errors import UsageError

_HINT = "write e.g. cuda:0-3, cuda:0,cuda:2, or cpu*2 (two CPU ranks, for testing)"
MAX_RANKS = 64  # tensor-parallel ranks one device list may name
_RANGE = re.compile(r"^cuda:(\d+)-(?:cuda:)?(\d+)$")
_ONE = re.compile(r"^(cpu|cuda|cuda:\d+)$")
_TIMES = re.compile(r"^(cpu|cuda:\d+)\*(\d+)$")


def parse_devices(text: str) -> tuple[str, ...]:
    """'cuda:0-3' -> ('cuda:0', 'cuda:1', 'cuda:2', 'cuda:3'); raises UsageError."""
    found: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError(f"empty entry in device list {text!r}", _HINT)
        if m := _RANGE.match(part):
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise UsageError(f"device range {part!r} runs backwards", f"write cuda:{hi}-{lo}")
            _check_count(text, len(found) + hi - lo + 1)
            found += [f"cuda:{i}" for i in range(lo, hi + 1)]
        elif m := _TIMES.match(part):
            times = int(m.group(2))
            if times < 1:
                raise UsageError(f"{part!r} asks for {times} ranks", f"at least one: {m.group(1)}*2")
            _check_count(text, len(found) + times)
            found += [m.group(1)] * times
        elif _ONE.match(part):
            found.append("cuda:0" if part == "cuda" else part)
        else:
            raise UsageError(f"cannot read device {part!r} in {text!r}", _HINT)
    gpus = [d for d in found if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise UsageError(f"device list {text!r} names a GPU twice", "give each rank its own GPU")
    if gpus and len(gpus) != len(found):
        raise UsageError(
            f"device list {text!r} mixes GPUs and the CPU",
            "a tensor-parallel target runs on GPUs only (or CPU ranks only)",
        )
    return tuple(found)


def _check_count(text: str, count: int) -> None:
    if count > MAX_RANKS:
        raise UsageError(
            f"device list {text!r} names {count} devices; at most {MAX_RANKS}",
            "one rank per GPU of this machine: `ssdlocal devices` lists them",
        )


def format_devices(devices: tuple[str, ...]) -> str:
    """('cuda:0', 'cuda:1', 'cuda:2') -> 'cuda:0-2'; other lists joined with commas."""
    if len(devices) > 1 and all(d == "cpu" for d in devices):
        return f"cpu*{len(devices)}"
    idx = [int(d.split(":")[1]) for d in devices if re.fullmatch(r"cuda:\d+", d)]
    if len(devices) > 1 and len(idx) == len(devices) and idx == list(range(idx[0], idx[0] + len(idx))):
        return f"cuda:{idx[0]}-{idx[-1]}"
    return ",".join(devices)


def plan_flags(plan) -> str:
    """The generate flags that reproduce a devices.Plan."""
    target = format_devices(plan.target_devices)
    flag = "--target-devices" if len(plan.target_devices) > 1 else "--target-device"
    if plan.draft_device is None:  # no room for the draft model
        return f"{flag} {target} --draft ngram"
    return f"{flag} {target} --draft-device {plan.draft_device}"
