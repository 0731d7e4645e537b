"""Files that could hang ssdlocal, exhaust its memory or fool it, and paths that are no model.

- FIFOs where a model file, a config or the settings file should be: refused, never opened;
- config.json sizes checked before anything is built: layers, vocabulary, parameters
  against the weight files' headers; strings, negative or zero sizes, deep nesting;
- GGUF headers whose counts no file of that size can hold;
- a cache folder that is a file, a binary config.toml;
- a corrupted quantized cache: never used, rebuilt with a warning;
- the persisted suffix memory: bad entries dropped with one warning, a failed save only
  a warning (the answer printed, no temporary file left);
- `--target /dev/zero` and friends: their own message, and no hint says to delete them.
Every refusal is `error:` + `hint:` and an exit code, fast, with no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import assert_clean_error, run_cli

ROOT = Path(__file__).resolve().parent.parent
_TQDM = ("Quantizing", "Converting", "quantize", "convert", "\r")  # progress bars on stderr


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (not hang) if the block takes longer: SIGALRM raises in the main thread."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s (blocked on a FIFO, or building a huge model?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def generate(monkeypatch, capsys, target, *extra):
    with deadline(60):
        return run_cli(
            monkeypatch,
            capsys,
            "generate",
            "hi",
            "--target",
            target,
            "--mode",
            "ar",
            "--max-new-tokens",
            "2",
            "--dtype",
            "float32",
            *extra,
        )


def variant(tiny_dir, tmp_path, name: str, **changes) -> Path:
    """A copy of the 1-layer tiny llama with config.json changed."""
    out = tmp_path / name
    shutil.copytree(tiny_dir["small_llama"], out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


# ----------------------------------------------------------------------------- FIFOs
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_fifo_in_a_checkpoint_is_refused_without_opening_it(monkeypatch, capsys, tiny_dir, tmp_path, name):
    ckpt = variant(tiny_dir, tmp_path, "fifo")
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    code, _, err = generate(monkeypatch, capsys, ckpt)
    assert_clean_error(code, err, 1, f"{name} is a FIFO", "replace")


def test_weight_files_are_opened_only_when_regular(tmp_path):
    """The reader itself refuses a FIFO (opened non-blocking, then checked)."""
    from ssdlocal.weights.formats.safetensors import SafetensorsReader
    from ssdlocal.core.errors import ModelLoadError

    os.mkfifo(tmp_path / "w.safetensors")
    with deadline(10), pytest.raises(ModelLoadError, match="not a regular file"):
        SafetensorsReader(tmp_path / "w.safetensors")


def test_a_fifo_as_the_config_or_the_gguf_is_refused(monkeypatch, capsys, tiny_dir, tmp_path):
    ckpt = variant(tiny_dir, tmp_path, "fifo-config")
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    assert_clean_error(*generate(monkeypatch, capsys, ckpt)[::2], 1, "config.json is a FIFO")
    os.mkfifo(tmp_path / "model.gguf")
    for backend in ("torch", "auto"):
        code, _, err = generate(monkeypatch, capsys, tmp_path / "model.gguf", "--target-backend", backend)
        assert_clean_error(code, err, 1, "model.gguf is a FIFO")


# ----------------------------------------------------------------------------- config.json sizes
@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_hidden_layers": 1_000_000}, "declares 1,000,000 layers, the weight files hold 1"),
        ({"vocab_size": 10**9}, "a vocabulary of 1,000,000,000 x 32"),
        ({"intermediate_size": 10**9}, "declares about"),  # ~10^11 parameters in one layer
        ({"hidden_size": 100_000, "intermediate_size": 1_000_000}, "the embedding in the weight files is 384 x 32"),
        ({"hidden_size": -64}, "hidden_size must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"hidden_size": "64"}, 'hidden_size must be a positive integer below 2,147,483,648, got "64"'),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads (3)"),
    ],
)
def test_config_sizes_are_checked_before_the_model_is_built(monkeypatch, capsys, tiny_dir, tmp_path, changes, needle):
    ckpt = variant(tiny_dir, tmp_path, "cfg", **changes)
    started = time.perf_counter()
    code, _, err = generate(monkeypatch, capsys, ckpt)
    assert_clean_error(code, err, 1, needle)
    assert "this is a bug" not in err and "delete" not in err
    assert time.perf_counter() - started < 10  # before: minutes of building layers, or gigabytes


def test_a_deeply_nested_config_is_refused(monkeypatch, capsys, tiny_dir, tmp_path):
    ckpt = variant(tiny_dir, tmp_path, "nested")
    (ckpt / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    code, _, err = generate(monkeypatch, capsys, ckpt)
    assert_clean_error(code, err, 1, "nested too deeply")
    assert "delete" not in err


def test_a_tensor_whose_shape_the_config_does_not_give_is_a_load_error(tiny_dir, tmp_path):
    """Same layers, vocabulary and no more parameters, but another width: refused by name."""
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.core.errors import ModelLoadError

    ckpt = variant(tiny_dir, tmp_path, "narrow", intermediate_size=32)
    with pytest.raises(ModelLoadError, match="does not match its config.json: .*size mismatch"):
        load_model(ckpt)


# ----------------------------------------------------------------------------- GGUF headers
def _gguf(*parts: bytes) -> bytes:
    return b"GGUF" + b"".join(parts) + b"\0" * 64


@pytest.mark.parametrize(
    "header",
    [
        _gguf(struct.pack("<IQQ", 3, 2**62, 0)),  # tensors
        _gguf(struct.pack("<IQQ", 3, 0, 2**62)),  # metadata keys
        _gguf(struct.pack("<IQQ", 3, 0, 1), struct.pack("<Q", 2**62)),  # a key's length
        _gguf(struct.pack("<IQQ", 3, 0, 1), struct.pack("<Q", 1), b"k", struct.pack("<IIQ", 9, 4, 2**62)),  # an array
        _gguf(struct.pack("<IQQ", 3, 1, 0), struct.pack("<Q", 1), b"t", struct.pack("<I", 2**31)),  # dimensions
        _gguf(
            struct.pack("<IQQ", 3, 0, 1),
            struct.pack("<Q", 1),
            b"k",
            struct.pack("<IIQ", 9, 8, 3),
            struct.pack("<Q", 2),
            b"ab",
            struct.pack("<Q", 2**62),
        ),  # a vocabulary string's length
        _gguf(
            struct.pack("<IQQ", 3, 0, 1),
            struct.pack("<Q", 1),
            b"k",
            struct.pack("<IIQ", 9, 8, 40),
            struct.pack("<Q", 1) + b"a",
        ),  # more vocabulary strings than the file holds
    ],
    ids=["tensors", "keys", "string", "array", "dims", "vocab-string", "vocab-count"],
)
def test_gguf_counts_no_file_of_its_size_can_hold_are_refused(tmp_path, header):
    from ssdlocal.weights.formats.gguf import GGUFHeader
    from ssdlocal.core.errors import ModelLoadError

    path = tmp_path / "x.gguf"
    path.write_bytes(header)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as info:
        GGUFHeader.read(path)
    assert "delete" not in info.value.hint and "replace it" in info.value.hint


def test_a_real_gguf_claiming_2_62_tensors_is_refused_on_every_backend(monkeypatch, capsys, tmp_path, tiny_gguf):
    data = bytearray(tiny_gguf[0].read_bytes())
    data[8:16] = struct.pack("<Q", 2**62)
    bad = tmp_path / "many.gguf"
    bad.write_bytes(bytes(data))
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / "cache"))
    for backend in ("torch", "auto"):
        code, _, err = generate(monkeypatch, capsys, bad, "--target-backend", backend)
        assert_clean_error(code, err, 1, "4,611,686,018,427,387,904 tensors", "replace it", skip=_TQDM)


# ----------------------------------------------------------------------------- folders and settings
def test_a_cache_folder_that_is_a_file_is_a_usage_error(monkeypatch, capsys, tmp_path, tiny_gguf):
    (tmp_path / "cache").write_text("not a folder")
    for cache in ("cache", "cache/sub"):
        monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path / cache))
        code, _, err = generate(monkeypatch, capsys, tiny_gguf[0], "--target-backend", "torch")
        assert_clean_error(code, err, 2, f"{tmp_path / 'cache'} is not a directory", "SSDLOCAL_CACHE")
        assert "delete" not in err


@pytest.mark.parametrize("kind", ["binary", "fifo"])
def test_a_config_toml_that_is_binary_or_a_fifo_is_a_usage_error(monkeypatch, capsys, tmp_path, kind):
    monkeypatch.setenv("SSDLOCAL_CONFIG_DIR", str(tmp_path))
    if kind == "binary":
        (tmp_path / "config.toml").write_bytes(b"\x00\xff\xfe\x89PNG binary")
    else:
        os.mkfifo(tmp_path / "config.toml")
    with deadline(30):
        code, _, err = run_cli(monkeypatch, capsys, "pairs")
    assert_clean_error(code, err, 2, "config.toml", "not UTF-8 text" if kind == "binary" else "is a FIFO")
    assert "delete" not in err


# ----------------------------------------------------------------------------- the quantized cache
def test_a_corrupted_quantized_cache_is_rebuilt_not_used(monkeypatch, capsys, caplog, tmp_path, tiny_gguf):
    """Every 97th byte of the cached int4 weights flipped (same size): before, the run used
    them silently and answered differently."""
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    args = ("--target-backend", "torch", "--quantization", "int4", "--json", "--ignore-eos", "--max-new-tokens", "6")
    code, clean, err = generate(monkeypatch, capsys, tiny_gguf[0], *args)
    assert code == 0, err
    (weights,) = (tmp_path / "quantized").glob("*/model.safetensors")
    data = bytearray(weights.read_bytes())
    for i in range(4096, len(data), 97):
        data[i] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        code, again, err = generate(monkeypatch, capsys, tiny_gguf[0], *args)
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "does not match the crc32" in warnings[0] and str(weights.parent) in warnings[0]
    assert json.loads(again)["outputs"] == json.loads(clean)["outputs"]
    from ssdlocal.core.files import check_digests

    assert check_digests(weights.parent) is None  # the rebuilt cache has its digests


# ----------------------------------------------------------------------------- suffix memory
def _memory_file(tmp_path: Path, target: Path) -> Path:
    from ssdlocal.draft.suffix import open_memory

    from ssdlocal.core.models import MemorySettings

    _, file = open_memory(MemorySettings(persist=True), str(target), 384)
    return file.path


def test_a_memory_file_with_ids_outside_the_vocabulary_never_fails_a_run(
    monkeypatch, capsys, caplog, tiny_dir, tmp_path
):
    monkeypatch.setenv("SSDLOCAL_CACHE", str(tmp_path))
    target = tiny_dir["small_llama"]
    path = _memory_file(tmp_path, target)
    prompt_ids = list(range(5, 40))
    key = f"{Path(target).resolve()}|vocab=384"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"model": key, "sequences": [prompt_ids + [10**9] * 8, prompt_ids + [-7] * 8, prompt_ids + [2**70] * 8]}
        )
    )
    with caplog.at_level("WARNING"):
        code, out, err = generate(
            monkeypatch, capsys, target, "--draft", "suffix", "--persist-suffix-memory", "--json", "--mode", "sd"
        )
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(path) in warnings[0] and "dropped 3 of 3" in warnings[0], warnings
    assert json.loads(out)["outputs"][0]["finish_reason"] in ("length", "stop")


def test_a_failed_memory_save_keeps_the_answer(tiny_dir, tmp_path):
    """File writes limited to 1 KiB (the memory file is larger): exit 0, the JSON answer
    on stdout, one warning, no temporary file."""
    import resource

    env = {**os.environ, "PYTHONPATH": str(ROOT), "SSDLOCAL_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    prompt = " ".join(f"w{i}" for i in range(80))  # ~300 tokens: a memory file of about 1.5 KB
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssdlocal",
            "generate",
            prompt,
            "--target",
            str(tiny_dir["small_llama"]),
            "--draft",
            "suffix",
            "--mode",
            "sd",
            "--persist-suffix-memory",
            "--json",
            "--max-new-tokens",
            "8",
            "--dtype",
            "float32",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=small_files,
    )
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["outputs"][0]["token_ids"]) == 8
    warnings = [line for line in run.stderr.splitlines() if "could not save the suffix memory" in line]
    assert len(warnings) == 1 and "Traceback" not in run.stderr, run.stderr
    assert not list(tmp_path.rglob("*.tmp-*"))


# ----------------------------------------------------------------------------- not a model at all
@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_a_device_as_the_target_gets_its_own_message(monkeypatch, capsys, target):
    code, _, err = generate(monkeypatch, capsys, target)
    assert_clean_error(code, err, 1, f"{target} is a character device, not a model", "--target")
    assert "delete" not in err and "Repo id" not in err
    monkeypatch.setenv("SSDLOCAL_TARGET", target)
    with deadline(60):
        code, _, err = run_cli(monkeypatch, capsys, "generate", "hi", "--mode", "ar")
    assert_clean_error(code, err, 1, f"{target} is a character device")
    assert "delete" not in err


def test_a_damaged_user_checkpoint_is_never_to_be_deleted(monkeypatch, capsys, tiny_dir, tmp_path):
    ckpt = variant(tiny_dir, tmp_path, "truncated")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, _, err = generate(monkeypatch, capsys, ckpt)
    assert_clean_error(code, err, 1, "cannot read the weights", "replace the model")
    assert "delete" not in err


def test_weights_larger_than_the_memory_available_are_refused_before_reading_them(tiny_dir, monkeypatch):
    from ssdlocal.backends.torch import loader
    from ssdlocal.backends.torch.loader import load_model
    from ssdlocal.core.errors import OutOfMemoryError

    built = []
    monkeypatch.setattr(loader, "read_state_dict", lambda *a, **k: built.append(1))
    monkeypatch.setattr("ssdlocal.backends.torch.kvcache.available_ram_bytes", lambda: 1000)
    with pytest.raises(OutOfMemoryError, match="weights of small_llama .* only 1000 B"):
        load_model(tiny_dir["small_llama"])
    assert not built
