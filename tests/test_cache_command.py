"""`ssdlocal cache`: every entry with its size and what it is for, in 80 columns; `cache
remove` by name, kind or --all, never while another process builds the entry, and
nothing half-removed left visible."""

from __future__ import annotations

import fcntl
import json

import pytest
from support.cli import assert_clean_error, run_cli


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    (root / "gguf").mkdir(parents=True)
    (root / "gguf" / "m-q4_k_m.gguf").write_bytes(b"g" * 3000)
    (root / "gguf" / "m-q4_k_m.gguf.verified.json").write_text("{}")
    (root / "gguf" / "m-q4_k_m.gguf.lock").write_text("")
    for kind, name, size in (
        ("quantized", "m-q4_k_m-int4-bfloat16-v2-0123456789abcdef", 2000),
        ("converted", "m-q4_k_m-bfloat16-0123456789abcdef", 5000),
        ("gguf-meta", "m-q4_k_m-0123456789abcdef", 10),
    ):
        entry = root / kind / name
        entry.mkdir(parents=True)
        (entry / "model.safetensors").write_bytes(b"w" * size)
        (root / kind / f"{name}.lock").write_text("")
    (root / "converted" / "digests.json").write_text("{}")
    monkeypatch.setenv("SSDLOCAL_CACHE", str(root))
    return root


def test_cache_lists_every_entry_with_its_size(cache, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "cache")
    assert code == 0, err
    assert "10.0 kB in 4 entries" in out  # 3000 + 2000 + 5000 + 10 bytes
    assert "quantized (2.0 kB): int4/int8 weights torch loads" in out
    assert "converted (5.0 kB): bf16 weights, only for --quantization none" in out
    assert "    3.0 kB  m-q4_k_m.gguf" in out
    assert ".lock" not in out and "verified" not in out and "digests" not in out
    assert all(len(line) <= 80 for line in out.splitlines()[1:])  # (the first names the folder)
    code, out, _ = run_cli(monkeypatch, capsys, "cache", "--json")
    payload = json.loads(out)
    assert payload["total_bytes"] == 10010 and {e["kind"] for e in payload["entries"]} == {
        "gguf",
        "quantized",
        "converted",
        "metadata",
    }


def test_remove_a_kind_and_a_name(cache, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "cache", "remove", "converted")
    assert code == 0, err
    assert "removed converted/m-q4_k_m-bfloat16-0123456789abcdef (5.0 kB)" in out
    assert not (cache / "converted" / "m-q4_k_m-bfloat16-0123456789abcdef").exists()
    assert (cache / "quantized" / "m-q4_k_m-int4-bfloat16-v2-0123456789abcdef").is_dir()
    code, out, err = run_cli(monkeypatch, capsys, "cache", "remove", "m-q4_k_m.gguf")
    assert code == 0, err
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == []  # its marker and lock too
    assert not list(cache.rglob("*.removing-*"))


def test_remove_refuses_while_an_entry_is_being_built(cache, monkeypatch, capsys):
    lock = cache / "quantized" / "m-q4_k_m-int4-bfloat16-v2-0123456789abcdef.lock"
    with open(lock, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # what ensure_quantized holds while it writes
        code, _, err = run_cli(monkeypatch, capsys, "cache", "remove", "quantized")
    assert_clean_error(code, err, 1, "being built by another ssdlocal process")
    assert (cache / "quantized" / "m-q4_k_m-int4-bfloat16-v2-0123456789abcdef").is_dir()


def test_remove_all_and_bad_names(cache, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "cache", "remove", "nonsense")
    assert_clean_error(code, err, 2, "nothing in the cache is called 'nonsense'")
    code, _, err = run_cli(monkeypatch, capsys, "cache", "remove", "m-q4")  # a prefix of several
    assert_clean_error(code, err, 2, "names 4 cache entries")
    code, _, err = run_cli(monkeypatch, capsys, "cache", "remove")
    assert_clean_error(code, err, 2, "nothing to remove")
    code, out, err = run_cli(monkeypatch, capsys, "cache", "remove", "--all")
    assert code == 0 and "freed 10.0 kB" in out, err
    code, out, _ = run_cli(monkeypatch, capsys, "cache")
    assert "0 bytes in 0 entries" in out
