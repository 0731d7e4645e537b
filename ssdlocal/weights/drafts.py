"""Drafts for a model pulled by name: smaller models of its family, found without a hub
search, that the pair check (weights/compat.check_paths) then verifies.

The family tables are built from the registry (models/pairs/*.toml: every pair's family,
its repositories and the sizes their names carry) plus the sizes each family ships
(FAMILY_SIZES). For a repository the candidates are, in order:

1. the draft of a registry pair whose target is this very repository;
2. registry drafts of the same line (its name without the size: `Qwen2.5-Coder-*-Instruct`);
3. siblings: the same organisation and name with a smaller size of the family, smallest
   first (`bartowski/Qwen2.5-Coder-7B-Instruct-GGUF` -> `...-0.5B-Instruct-GGUF`);
4. the other registry drafts of the family.

The family is the registry pair's, else the model type the hub read from the repository
(weights/formats/arch.py: qwen2 -> qwen2.5), else the registry family whose names share the
repository's stem (`Qwen2.5-Coder`). A candidate counts only where the hub lists it, it is
smaller than the target, and its tokenizer passes the pair check once downloaded; the
caller (cli/pull.py) tries them in this order and falls back to suffix drafting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ssdlocal.weights.formats.archs import FAMILY_SIZES
from ssdlocal.weights.pairs import Pair

MAX_CANDIDATES = 6  # candidates a pull lists on the hub at most
DRAFT_QUANTS = ("Q8_0",)  # a GGUF draft's preferred quantization (then the target's)
_SIZE = re.compile(r"(?i)(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([BM])(?![A-Za-z0-9])")


@dataclass(frozen=True)
class Candidate:
    """A draft to try: a repository (a GGUF one with the quantizations to look for, or the
    exact file a registry pair names) and why it is a candidate."""

    repo: str
    why: str
    quants: tuple[str, ...] = ()  # GGUF: quantizations in order of preference; () safetensors
    filename: str | None = None  # a registry pair's GGUF file


def size_of(repo: str) -> float | None:
    """The parameter count (billions) a repository's name carries: `...-7B-...` -> 7.0."""
    found = _SIZE.findall(repo.rsplit("/", 1)[-1])
    if not found:
        return None
    number, unit = found[-1]
    return float(number) / (1000.0 if unit.upper() == "M" else 1.0)


def line_of(repo: str) -> str:
    """The name without organisation, size and GGUF suffix: `qwen2.5-coder-*-instruct`."""
    name = repo.rsplit("/", 1)[-1]
    name = re.sub(r"(?i)-gguf$", "", name)
    return _SIZE.sub("*", name).lower()


def stem_of(repo: str) -> str:
    """The name before its size: `Qwen/Qwen2.5-Coder-7B-Instruct` -> `qwen2.5-coder`."""
    return line_of(repo).split("*", 1)[0].rstrip("-_. ")


def _with_size(repo: str, size: float) -> str:
    """`repo` with the last size in its name replaced by `size` (as the family writes it)."""
    org, name = repo.rsplit("/", 1)
    matches = list(_SIZE.finditer(name))
    last = matches[-1]
    unit = last.group(2)
    value = size * 1000 if unit.upper() == "M" else size
    text = f"{value:g}"
    return f"{org}/{name[: last.start()]}{text}{unit}{name[last.end() :]}"


def _repos(pair: Pair, gguf: bool) -> tuple[str | None, str | None]:
    """The pair's target and draft model repositories (a draft head is no model of the family:
    its name carries its target's size)."""
    if gguf:
        return (pair.gguf_target.repo if pair.gguf_target else None, pair.gguf_draft.repo if pair.gguf_draft else None)
    return pair.target.repo, pair.draft.repo if pair.draft and not pair.draft.head else None


def family_of(repo: str, model_type: str | None, registry: list[Pair]) -> str | None:
    """The registry family of a repository (see the module's docstring for the order)."""
    for pair in registry:
        if repo in (*_repos(pair, False), *_repos(pair, True)):
            return pair.family or None
    if model_type:
        from ssdlocal.weights.formats.archs import find

        described = find(None, model_type)
        if described is not None:
            return described.pair_family or described.model_type
    stem = stem_of(repo)
    for pair in registry:
        names = [r for r in (*_repos(pair, False), *_repos(pair, True)) if r]
        if stem and any(stem_of(r) == stem for r in names):
            return pair.family or None
    return None


def family_sizes(family: str | None, registry: list[Pair]) -> list[float]:
    """Every size the family's models come in: FAMILY_SIZES and the registry's names."""
    sizes = set(FAMILY_SIZES.get(family or "", ()))
    for pair in registry:
        if pair.family == family:
            for r in (*_repos(pair, False), *_repos(pair, True)):
                size = size_of(r) if r else None
                if size is not None:
                    sizes.add(size)
    return sorted(sizes)


def _registry_draft(pair: Pair, gguf: bool, why: str, quants: tuple[str, ...]) -> Candidate | None:
    if gguf:
        ref = pair.gguf_draft
        if ref is None or not ref.repo or not ref.filename:
            return None
        return Candidate(ref.repo, why, (ref.quant,) if ref.quant else quants, ref.filename)
    if pair.draft is None or not pair.draft.repo or pair.draft.head or pair.source != "hf":
        return None  # no draft model (a draft head drafts only beside a registry pair's target)
    return Candidate(pair.draft.repo, why)


def candidates(repo: str, family: str | None, registry: list[Pair], quant: str | None = None) -> list[Candidate]:
    """Drafts to try for `repo` (a GGUF one when `quant` is given), in order, deduplicated,
    smaller than the target by their names; at most MAX_CANDIDATES."""
    gguf = quant is not None
    quants = tuple(dict.fromkeys((*DRAFT_QUANTS, quant))) if quant else ()
    size = size_of(repo)
    found: list[Candidate] = []
    family_pairs = [p for p in registry if family and p.family == family]
    for pair in registry:  # 1. this repository's registry pair
        if _repos(pair, gguf)[0] == repo:
            found.append(_registry_draft(pair, gguf, f"the draft of the registry pair {pair.name}", quants))
    line = line_of(repo)
    for pair in family_pairs:  # 2. the same line
        draft = _repos(pair, gguf)[1]
        if draft and line_of(draft) == line:
            found.append(_registry_draft(pair, gguf, f"the {family} family's draft in the registry", quants))
    if size is not None:  # 3. siblings of the same organisation
        for smaller in (s for s in family_sizes(family, registry) if s < size):
            found.append(Candidate(_with_size(repo, smaller), f"a smaller model of the {family} family", quants))
    for pair in family_pairs:  # 4. the family's other registry drafts
        found.append(_registry_draft(pair, gguf, f"the {family} family's draft in the registry", quants))
    unique: dict[str, Candidate] = {}
    for c in found:
        if c is not None and c.repo != repo and c.repo not in unique:
            small = size_of(c.repo)
            if size is None or small is None or small < size:
                unique[c.repo] = c
    return list(unique.values())[:MAX_CANDIDATES]
