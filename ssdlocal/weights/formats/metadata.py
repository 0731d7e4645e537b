"""A GGUF file's key and its metadata directory: what needs a GGUF's config and tokenizer
but no weights reads this.

`content_key` is the file's sha256, computed once per (path, size, mtime, inode) and
remembered (or read from the `.verified.json` a verified download leaves): every cache
built from a GGUF is keyed by it, so a copy or a touched file hits the cache and changed
content never does. `metadata_dir` extracts config.json, generation_config.json and the
tokenizer into a small cached directory, in a child process (transformers' reader touches
every page of the file), with the config fields the architecture's description reads from
the file itself (`gguf_config`: what transformers' reader leaves out, such as an expert's
width); a file whose rope scaling transformers' reader drops is refused by name. The
converters run it `in_background` while they read tensors. Cache directories
appear whole: `build_atomically` builds under a temporary name and a lock, then renames.
Knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

from ssdlocal.core.errors import ModelLoadError
from ssdlocal.core.files import file_lock
from ssdlocal.core.paths import cache_dir
from ssdlocal.core.progress import model_label, reporter
from ssdlocal.weights.formats.archs import for_gguf, unsupported
from ssdlocal.weights.formats.gguf import GGUFHeader
from ssdlocal.weights.formats.gguf_tensors import gguf_config_fields
from ssdlocal.weights.formats.hf_files import scales_rope

META_MARKER = "ssdlocal-meta.json"  # written last into a metadata directory


def content_key(gguf_path: Path) -> str:
    """sha256 of the file, computed once per (path, size, mtime, inode) and remembered.

    A download verified by ssdlocal.weights.assets already records it next to the file.
    """
    st = gguf_path.stat()
    verified = gguf_path.with_name(gguf_path.name + ".verified.json")
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(verified.read_text())
        if info.get("size") == st.st_size and isinstance(info.get("sha256"), str):
            return info["sha256"]
    stat_key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = cache_dir() / "gguf-keys" / (hashlib.sha256(stat_key.encode()).hexdigest()[:32] + ".txt")
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    digest = hashlib.sha256()
    progress, done = reporter(), 0
    stage = f"checking {model_label(gguf_path)} (sha256)"
    with open(gguf_path, "rb") as fh:
        while block := fh.read(16 << 20):
            digest.update(block)
            done += len(block)
            if progress:
                progress(stage, done, st.st_size)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
    tmp.write_text(digest.hexdigest() + "\n")
    os.replace(tmp, memo)
    return digest.hexdigest()


@contextlib.contextmanager
def in_background(fn, *args):
    """Run fn(*args) in a thread while the block runs; yields a function returning its
    result (re-raising its error) once the block is done."""
    import threading

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="ssdlocal-gguf-metadata", daemon=True)
    thread.start()
    try:
        yield lambda: box["value"]
    finally:
        thread.join()  # (a failure in the block wins over the thread's)
    if "error" in box:
        raise box["error"]


def build_atomically(out: Path, marker: str, build) -> Path:
    """Run build(tmp) into a temporary sibling of `out`, write nothing half-done, rename."""
    if (out / marker).is_file():
        return out
    with file_lock(out.with_name(out.name + ".lock")):  # one converter per file; others wait
        if (out / marker).is_file():
            return out
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            build(tmp)
            shutil.rmtree(out, ignore_errors=True)  # a stale directory without its marker
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- metadata


def metadata_dir(gguf_path: Path) -> Path:
    """A cached directory with only config.json, generation_config.json and the tokenizer
    of a GGUF file: what needs no weights (tokenizer checks, config, planning) reads it.

    transformers builds both from the GGUF metadata, parsing the file with a reader that
    touches every page of it (20-40 s and the file's size in resident memory for the offline
    1.5B on 2 cores), so that runs once, in a child process: the caller's memory stays that
    of its model (and the torch backend's quantizer runs meanwhile).
    """
    gguf_path = Path(gguf_path)
    stem = gguf_path.name.removesuffix(".gguf")
    out = cache_dir() / "gguf-meta" / f"{stem}-{content_key(gguf_path)[:16]}"
    if (out / META_MARKER).is_file():
        return out
    header = GGUFHeader.read(gguf_path)
    arch = for_gguf(header.metadata.get("general.architecture"), gguf_path.name)
    tied = arch.gguf.theirs("lm_head.weight") not in {t.name for t in header.tensors}
    chat = "tokenizer.chat_template" in header.metadata
    fields = gguf_config_fields(header, arch)  # read here: the child knows no architecture registered in-process
    scaling = header.metadata.get(f"{header.metadata.get('general.architecture')}.rope.scaling.type")

    def build(tmp: Path) -> None:
        progress = reporter()
        stage = f"reading tokenizer: {model_label(gguf_path)}"
        if progress:
            progress(stage, 0, 1)
        _run_metadata_child(gguf_path, tmp, arch, tied, chat, fields)
        config = json.loads((tmp / "config.json").read_text())
        dropped = scaling not in (None, "none") and "rope_parameters" not in fields  # not read by gguf_config.py
        if dropped and not scales_rope(config):  # e.g. Gemma 3 4B and larger
            raise unsupported(
                f"{arch.name} GGUF with rope scaling {scaling!r}, which transformers does not read from the file's metadata"
            )
        if progress:
            progress(stage, 1, 1)

    return build_atomically(out, META_MARKER, build)


def _run_metadata_child(gguf_path: Path, tmp: Path, arch, tied: bool, chat: bool, fields: dict) -> None:
    """Write the metadata directory's files into `tmp` from a child process."""
    import subprocess
    import sys

    import ssdlocal

    env = dict(os.environ)  # the child imports this very package, wherever it lives
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(ssdlocal.__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p
    )
    args = [str(gguf_path), str(tmp), arch.hf_architectures[0], str(int(tied)), str(int(chat)), json.dumps(fields)]
    run = subprocess.run(
        [sys.executable, "-c", _METADATA_CHILD, *args], env=env, capture_output=True, text=True, check=False
    )
    error = tmp / "error.json"
    if error.is_file():
        raise ModelLoadError(**json.loads(error.read_text()))
    if run.returncode != 0 or not (tmp / "config.json").is_file():
        tail = (run.stderr or "").strip().splitlines()[-3:]
        raise ModelLoadError(
            f"reading the metadata of {gguf_path.name} failed: {' / '.join(tail)}",
            "run again; if it persists the file may be damaged: fetch it again",
        )
    (tmp / META_MARKER).write_text(json.dumps({"source": gguf_path.name}) + "\n")


_METADATA_CHILD = (
    "import sys; from ssdlocal.weights.formats.metadata import _write_metadata; "
    "_write_metadata(*sys.argv[1:4], sys.argv[4] == '1', sys.argv[5] == '1', sys.argv[6])"
)


def _write_metadata(gguf_path: str, out: str, architecture: str, tied: bool, chat: bool, fields: str = "{}") -> None:
    """Child process: transformers' config + tokenizer of the GGUF, saved into `out`, with
    `fields` (JSON: config field -> value the file states, gguf_config_fields) set."""
    import torch

    from ssdlocal.core.errors import SSDLocalError
    from ssdlocal.weights.formats import hf_files

    given = json.loads(fields)
    _parse_metadata_once(hide_rope_scaling="rope_parameters" in given)
    try:
        config, tokenizer = hf_files.read_config_and_tokenizer(Path(gguf_path))
        # tied iff the file has no separate output matrix (llama.cpp then reuses the embedding)
        config.tie_word_embeddings = tied
        for name, value in given.items():  # what transformers' reader left out or misread
            setattr(config, name, value)
        hf_files.write_config_and_tokenizer(Path(out), config, tokenizer, architecture, torch.bfloat16)
        hf_files.check_chat_template(Path(out), {"has_chat_template": chat})
    except SSDLocalError as exc:
        (Path(out) / "error.json").write_text(json.dumps({"message": exc.message, "hint": exc.hint}))


def _parse_metadata_once(hide_rope_scaling: bool = False) -> None:
    """transformers parses the whole GGUF (every vocabulary string through numpy views,
    ~20 s for the offline 1.5B on 2 cores) once for the config and again for the tokenizer;
    in the metadata child the second asks for what the first already read.
    `hide_rope_scaling`: its reader does not see the file's `*.rope.scaling.*` keys (for
    gpt-oss it fails on them; the rotary parameters come from gguf_config.py instead)."""
    import functools

    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if hide_rope_scaling:

        class Reader(gguf.GGUFReader):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                for key in [k for k in self.fields if ".rope.scaling." in k]:
                    del self.fields[key]

        gguf.GGUFReader = Reader  # transformers imports it from the package as it reads

    original = gguf_utils.load_gguf_checkpoint

    @functools.lru_cache(maxsize=2)
    def metadata_only(path: str):
        return original(path, return_tensors=False)

    def load(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(path, return_tensors, *args, **kwargs)
        return metadata_only(str(path))

    gguf_utils.load_gguf_checkpoint = load
