"""Hardening against bad and huge input: every case is an `error:` + `hint:` pair with
exit 2 (usage) or 1 (runtime), promptly, never a hang, a crash or a traceback.

Seeds over the whole 64-bit range work in every mode; tiny temperatures are refused
(they would overflow to NaN); K, fan-out and device lists have caps; a KV cache larger
than the free memory is refused before it is allocated; allocator failures are named.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.cli import assert_clean_error, run_cli

from ssdlocal.core.config import Mode, SamplingParams, SpecConfig
from ssdlocal.core.errors import OutOfMemoryError, UsageError
from ssdlocal.core.config import NgramDraft

SEED_MAX = 2**64 - 1


def gen(tiny, *extra):
    return [
        "generate",
        "Hello world",
        "--target",
        tiny["llama"],
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--mode",
        "ar",
        *extra,
    ]


def sd(tiny, *extra):
    return gen(tiny, "--mode", "sd", "--draft", tiny["draft_llama"], *extra)


# --------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_the_largest_seed_works_in_every_mode(monkeypatch, capsys, tiny_dir, mode):
    args = gen(
        tiny_dir,
        "--mode",
        mode,
        "--draft",
        tiny_dir["draft_llama"],
        "--temperature",
        "0.8",
        "--seed",
        str(SEED_MAX),
        "--json",
    )
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err


@pytest.mark.parametrize("seed", [SEED_MAX + 1, -1])
def test_seeds_outside_64_bits_are_usage_errors(monkeypatch, capsys, tiny_dir, seed):
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--seed", str(seed)))
    assert_clean_error(code, err, 2, "seed must be a whole number from 0 to", "--seed")


def test_derived_streams_wrap_at_64_bits():
    assert SamplingParams(seed=SEED_MAX).stream_seed(7919) == 7918
    assert SamplingParams(seed=5).stream_seed(7919) == 5 + 7919  # unchanged in the usual range


# --------------------------------------------------------------------------- temperature
@pytest.mark.parametrize("value", ["1e-40", "5e-5", "inf"])
def test_tiny_or_infinite_temperatures_are_refused(monkeypatch, capsys, tiny_dir, value):
    code, _, err = run_cli(monkeypatch, capsys, *sd(tiny_dir, "--temperature", value))
    assert_clean_error(code, err, 2, "temperature", "--temperature 0" if value != "inf" else "0.7")


def test_smallest_allowed_temperature_samples_finite_probabilities():
    from ssdlocal.core.sampling import logits_to_probs

    p = logits_to_probs(torch.tensor([[80.0, 79.0, -50.0]]), SamplingParams(temperature=1e-4))
    assert torch.isfinite(p).all() and p.sum().item() == pytest.approx(1.0)


# --------------------------------------------------------------------------- K and fan-out
def test_huge_fan_out_is_refused_at_once(monkeypatch, capsys, tiny_dir):
    t0 = time.monotonic()
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        *gen(tiny_dir, "--mode", "ssd", "--draft", tiny_dir["draft_llama"], "--fan-out", "1000000,1,1,1,1"),
    )
    assert_clean_error(code, err, 2, "fan-out", "branches per row", "at most 256")
    assert time.monotonic() - t0 < 10


def test_k_is_capped():
    with pytest.raises(UsageError, match="at most 32"):
        SpecConfig(mode=Mode.SD, k=1000, draft=NgramDraft())
    assert SpecConfig(mode=Mode.SD, k=32, draft=NgramDraft()).k == 32


# --------------------------------------------------------------------------- device lists
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cpu*0", "asks for 0 ranks"),
        ("cuda:0-999999999", "at most 64"),
        ("cpu*100000", "at most 64"),
    ],
)
def test_device_lists_are_bounded(monkeypatch, capsys, tiny_dir, text, needle):
    t0 = time.monotonic()
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir, "--target-devices", text))
    assert_clean_error(code, err, 2, needle)
    assert time.monotonic() - t0 < 10


# --------------------------------------------------------------------------- memory
def test_kv_cache_larger_than_free_memory_is_refused_before_allocating(tiny_dir, monkeypatch):
    from ssdlocal.backends.torch import kvcache
    from ssdlocal.backends.torch.loader import load_model

    loaded = load_model(tiny_dir["llama"])
    monkeypatch.setattr(kvcache, "available_ram_bytes", lambda: 1 << 20)  # 1 MiB free
    with pytest.raises(OutOfMemoryError) as info:
        loaded.model.setup_cache(4, 100_000, torch.float32, torch.device("cpu"))
    need = 2 * 2 * 4 * 2 * 100_000 * 16 * 4  # layers, k+v, rows, kv heads, slots, head dim, fp32
    assert f"KV cache of 4 x 100000 slots needs {need / 2**20:.1f} MiB" in info.value.message
    assert "--k" in info.value.hint and "--max-new-tokens" in info.value.hint
    loaded.model.setup_cache(1, 64, torch.float32, torch.device("cpu"))  # small ones still fit


def _cpu_allocator_failure(*args, **kwargs):
    torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator's own error (1 PiB)


@pytest.mark.parametrize(
    "where",
    [
        "ssdlocal.backends.torch.runner.TorchRunner.feed",  # engine forward
        "ssdlocal.backends.torch.runner.TorchRunner.reset",  # CLI edge
    ],
)
def test_cpu_out_of_memory_is_a_clean_error_with_the_size(monkeypatch, capsys, tiny_dir, where):
    monkeypatch.setattr(where, _cpu_allocator_failure)
    code, _, err = run_cli(monkeypatch, capsys, *gen(tiny_dir))
    assert_clean_error(code, err, 1, "out of memory", "1024.0 TiB", "--k", "--max-new-tokens")
    assert "unexpected" not in err and "bug" not in err
