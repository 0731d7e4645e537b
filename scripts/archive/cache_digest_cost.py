"""What checking a cached conversion's digests costs before each load.

Times, per cache directory (default: every quantized and converted cache under the
ssdlocal cache), the check every load runs (`core.files.check_digests`: the crc32 of each
file, the same work whether or not a digest file is there yet), sha256 over the same
files for comparison, a plain read of them (the page-cache floor), and with `--load` one
`load_model` of the directory with the check and one without, interleaved. Medians of
`--repeats` runs; the files are read once first, so all runs read from the page cache.

    python scripts/archive/cache_digest_cost.py --repeats 5 --load
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _files(directory: Path) -> list[Path]:
    return [p for p in sorted(directory.iterdir()) if p.is_file()]


def _read(directory: Path) -> None:
    buffer = memoryview(bytearray(8 << 20))
    for path in _files(directory):
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


def _crc32(directory: Path) -> None:
    from ssdlocal.core.files import crc32_file

    for path in _files(directory):
        crc32_file(path)


def _sha256(directory: Path) -> None:
    from ssdlocal.core.files import sha256_file

    for path in _files(directory):
        sha256_file(path)


def _load(directory: Path, checked: bool) -> None:
    from unittest import mock

    from ssdlocal.backends.torch import loader

    quant = (
        json.loads((directory / "quantization.json").read_text())["scheme"]
        if (directory / "quantization.json").is_file()
        else "none"
    )
    if checked:
        model = loader.load_model(directory, "cpu", "bfloat16", quant)
    else:
        with mock.patch.object(loader, "check_digests", lambda d: None):
            model = loader.load_model(directory, "cpu", "bfloat16", quant)
    del model


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from ssdlocal.core.paths import cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="*", type=Path, help="cache directories (default: all under the cache)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load", action="store_true", help="also time load_model with and without the check")
    args = parser.parse_args()
    dirs = args.dirs or sorted(
        p
        for kind in ("quantized", "converted")
        for p in (cache_dir() / kind).glob("*")
        if p.is_dir() and not p.name.count(".tmp-")
    )
    rows = []
    for directory in dirs:
        size = sum(p.stat().st_size for p in _files(directory))
        _read(directory)  # warm the page cache
        row = {
            "dir": directory.name,
            "bytes": size,
            "read_s": _median(lambda d=directory: _read(d), args.repeats),
            "crc32_s": _median(lambda d=directory: _crc32(d), args.repeats),
            "sha256_s": _median(lambda d=directory: _sha256(d), args.repeats),
        }
        if args.load:
            with_check, without = [], []
            for _ in range(args.repeats):
                for checked, out in ((False, without), (True, with_check)):
                    start = time.perf_counter()
                    _load(directory, checked)
                    out.append(time.perf_counter() - start)
            row["load_s"], row["load_checked_s"] = statistics.median(without), statistics.median(with_check)
        rows.append(row)
        gb = size / 1e9
        line = (
            f"{directory.name}: {gb:.3f} GB; read {row['read_s']:.3f} s, crc32 (the check) "
            f"{row['crc32_s']:.3f} s = {gb / row['crc32_s']:.2f} GB/s, sha256 {row['sha256_s']:.3f} s"
        )
        if args.load:
            line += f"; load_model {row['load_s']:.2f} s without the check, {row['load_checked_s']:.2f} s with it"
        print(line, flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
