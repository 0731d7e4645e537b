"""Safe file operations shared by every cache: an exclusive lock between processes,
atomic writes (never a half-written file under the final name), content digests (sha256
keys; a fast crc32 record of a cache directory's files, checked before they are used),
and what a path is when it is not a plain file (a FIFO blocks whoever opens it).

Standard library only; knows nothing about what the files hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_CHUNK_BYTES = 8 << 20
DIGEST_FILE = "ssdlocal-digests.json"  # in a cache directory: each file's size and crc32
_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if missing), released on exit or death."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locking, writes are still atomic
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def kind_of(path: Path) -> str | None:
    """What a path that is neither a directory nor a regular file is ("a FIFO ..."); None
    for directories, regular files and paths that do not exist."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((name for test, name in _SPECIAL if test(mode)), None)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def remembered_sha256(path: Path, memo: Path) -> str:
    """sha256 of `path`'s content, remembered in the JSON file `memo` by the file's path,
    size, mtime, ctime and inode: an unchanged file is read once, a rewritten one again."""
    import json

    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    lock = memo.with_name(memo.name + ".lock")

    def read() -> dict:
        try:
            found = json.loads(memo.read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    with file_lock(lock):
        hit = read().get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = sha256_file(path)
    try:
        with file_lock(lock):
            data = read()
            data[key] = {"stamp": stamp, "sha256": digest}
            atomic_write_text(memo, json.dumps(data, indent=1) + "\n")
    except OSError:  # a read-only cache only costs hashing again next time
        pass
    return digest


def crc32_file(path: Path) -> int:
    """zlib's crc32 of a file's bytes (about 2 GB/s here: the cheapest check that every
    byte is the one written; a digest against corruption, not against an attacker)."""
    import zlib

    crc, buffer = 0, bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc


def record_digests(directory: Path) -> None:
    """Record the size and crc32 of every file in `directory` (not its subfolders) in its
    DIGEST_FILE; call it last, before the directory's marker."""
    import json

    files = {
        p.name: {"size": p.stat().st_size, "crc32": f"{crc32_file(p):08x}"}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != DIGEST_FILE
    }
    atomic_write_text(directory / DIGEST_FILE, json.dumps({"algorithm": "crc32", "files": files}, indent=1) + "\n")


def check_digests(directory: Path) -> str | None:
    """None when every file `record_digests` recorded in `directory` still has its size and
    crc32; else what is wrong (no record, a file missing, changed or unreadable)."""
    import json

    try:
        record = json.loads((directory / DIGEST_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        record = None
    files = record.get("files") if isinstance(record, dict) and record.get("algorithm") == "crc32" else None
    if not isinstance(files, dict):
        return f"it has no readable {DIGEST_FILE} (written by an older ssdlocal, or damaged)"
    for name, want in files.items():
        path = directory / Path(str(name)).name
        try:
            if not isinstance(want, dict) or path.stat().st_size != want.get("size"):
                return f"{path.name} has another size than when it was written"
            if f"{crc32_file(path):08x}" != want.get("crc32"):
                return f"{path.name} does not match the crc32 recorded when it was written"
        except OSError as exc:
            return f"{path.name} cannot be read ({exc.strerror or exc})"
    return None
