"""Safe file operations shared by every cache: an exclusive lock between processes,
atomic writes (never a half-written file under the final name), content digests.

Standard library only; knows nothing about what the files hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

_CHUNK_BYTES = 8 << 20


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
