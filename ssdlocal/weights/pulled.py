"""A model pulled by its repository id: the plan (what the target and its first draft
candidate will download), the download itself with the draft verified by the pair check,
and the pair file written for it, so that `generate --pair NAME` and every other command
load it like a registry pair.

`make_plan` lists the repository and the draft candidates on the hub (repo.py, drafts.py)
and downloads nothing. `pull_model` fetches the target through hub.py (the same calls,
progress, resume and trust on first use as a pair pull), then tries the candidates in
order: a safetensors draft's tokenizer files first, so a draft that fails the pair check
(weights/compat.check_paths) is never downloaded whole; a GGUF draft carries its tokenizer
inside, so it is checked once fetched, and removed again when it fails. Without a draft
that passes, the pair drafts with suffix proposals. The pair file pins every commit. No UI:
lines for the user go to `say`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ssdlocal.core.errors import AssetError, IncompatiblePairError, UsageError
from ssdlocal.core.models import BackendName
from ssdlocal.weights import cache
from ssdlocal.weights.drafts import Candidate, candidates, family_of
from ssdlocal.weights.pairs import GGUFRef, ModelRef, Pair, load_pairs, user_dir
from ssdlocal.weights.repo import TOKENIZER_FILES, RepoSpec, Selection, list_repo, select

MARKER = "# written by `ssdlocal pull"  # a pair file's first line when pull wrote it
SAFETENSORS_PATTERNS = ("*.safetensors", "*.json", "tokenizer*", "merges.txt", "vocab.json", "*.model", "*.jinja")
TOP_LEVEL_ONLY = ("*/*",)  # ignore patterns: files in folders (original/, onnx/) are not fetched


@dataclass
class PullPlan:
    """What a pull of `spec` will download: the target, and the first draft candidate the
    hub lists (None: no candidate is listed; suffix drafting). `skipped` says why earlier
    candidates were passed over; `later` are the candidates not listed yet."""

    spec: RepoSpec
    name: str
    family: str | None
    target: Selection
    draft: Selection | None = None
    draft_why: str = ""
    skipped: list[str] = field(default_factory=list)
    later: list[Candidate] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.target.total + (self.draft.total if self.draft else 0)


@dataclass(frozen=True)
class PulledModel:
    """Where a pulled model and its draft are, the pair written for them, and what the
    pair check said (warnings) or why there is no draft model."""

    pair: Pair
    file: Path
    target: Path
    draft: Path | None
    warnings: tuple[str, ...] = ()


def pair_name(spec: RepoSpec, taken: dict[str, Pair]) -> str:
    """The pair's name: the repository's name in lower case, its quantization appended
    (`qwen2.5-7b-instruct-q4_k_m`); with the organisation in front when a pair not written
    by pull has that name."""
    org, name = spec.repo.lower().split("/", 1)
    base = name.removesuffix("-gguf") + (f"-{spec.quant.lower()}" if spec.quant else "")
    for candidate in (base, f"{org}-{base}"):
        pair = taken.get(candidate)
        if pair is None or _written_by_pull(pair.file):
            return candidate
    raise UsageError(
        f"the pair names {base!r} and {org}-{base!r} are taken",
        f"rename the pair file {taken[base].file} (or remove it), then pull again",
    )


def _written_by_pull(path: Path | None) -> bool:
    try:
        return path is not None and path.read_text().startswith(MARKER)
    except OSError:
        return False


def _listed(candidate: Candidate, target: Selection) -> tuple[Selection | None, str]:
    """The candidate's files on the hub, or None and why it does not count."""
    try:
        listing = list_repo(candidate.repo)
    except AssetError as exc:
        return None, f"{candidate.repo}: {exc.message}"
    picks = [q for q in candidate.quants if q] or [None]
    if candidate.filename:
        listing = dataclasses.replace(listing, files={candidate.filename: listing.files.get(candidate.filename, 0)})
    for quant in picks:
        try:
            chosen = select(listing, quant)
        except UsageError:
            continue
        if chosen.weight_bytes >= target.weight_bytes:
            return None, f"{candidate.repo}: not smaller than the target"
        return chosen, ""
    return None, f"{candidate.repo}: no {' or '.join(q or 'safetensors' for q in picks)} files"


def next_draft(plan: PullPlan) -> Selection | None:
    """List candidates until one counts (plan.draft, plan.draft_why); None when none is left."""
    while plan.later:
        candidate = plan.later.pop(0)
        chosen, why_not = _listed(candidate, plan.target)
        if chosen is not None:
            plan.draft, plan.draft_why = chosen, candidate.why
            return chosen
        plan.skipped.append(why_not)
    plan.draft, plan.draft_why = None, ""
    return None


def make_plan(spec: RepoSpec, revision: str = "main") -> PullPlan:
    """List the repository and the draft candidates (nothing is downloaded)."""
    target = select(list_repo(spec.repo, revision), spec.quant)
    registry = list(load_pairs().values())
    family = family_of(spec.repo, target.model_type, registry)
    name = pair_name(spec, {p.name: p for p in registry})
    plan = PullPlan(spec, name, family, target, later=candidates(spec.repo, family, registry, spec.quant))
    next_draft(plan)
    return plan


def _gb(size: int) -> float:
    return round(size / 1e9, 3)


def to_pair(plan: PullPlan, file: Path | None = None) -> Pair:
    """The pair of the plan's target and its current draft (suffix drafting without one)."""
    t, d = plan.target, plan.draft
    gguf = t.gguf is not None
    desc = f"{plan.spec} + " + (f"{d.repo} draft" if d else "suffix drafting") + " (pulled by name)"

    def model(sel: Selection) -> ModelRef:
        return ModelRef(repo=sel.repo, revision=sel.commit, bf16_gb=_gb(sel.weight_bytes))

    def gguf_ref(sel: Selection | None) -> GGUFRef | None:
        if sel is None or sel.gguf is None:
            return None
        return GGUFRef(sel.repo, sel.commit, sel.gguf, quant=sel.quant, size_gb=_gb(sel.weight_bytes))

    return Pair(
        name=plan.name,
        description=desc,
        family=plan.family or "",
        source="hf",
        target=model(t),
        draft=model(d) if d else None,
        gated=t.gated,
        allow_patterns=SAFETENSORS_PATTERNS,
        ignore_patterns=TOP_LEVEL_ONLY,
        gguf_target=gguf_ref(t),
        gguf_draft=gguf_ref(d),
        file=file,
        draft_word=None if d else "suffix",
        weights="gguf" if gguf else "safetensors",
    )


def pair_toml(pair: Pair, spec: RepoSpec) -> str:
    """The pair file of a pulled model (every revision a commit id)."""

    def q(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return f"{v:g}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(q(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [
        f"{MARKER} {spec}`; `ssdlocal rm {pair.name}` removes it with the model's files",
        f"name = {q(pair.name)}",
        f"description = {q(pair.description)}",
        f"family = {q(pair.family)}",
        'source = "hf"',
        f"weights = {q(pair.weights)}",
        f"gated = {q(pair.gated)}",
    ]
    if pair.draft is None:
        lines.append(f"draft = {q(pair.draft_word)}")
    for table, ref in (("target", pair.target), ("draft", pair.draft)):
        if ref is not None:
            lines += ["", f"[{table}]", f"repo = {q(ref.repo)}", f"revision = {q(ref.revision)}"]
            lines.append(f"bf16_gb = {q(ref.bf16_gb)}  # the weights' bytes as stored")
    lines += [
        "",
        "[torch]",
        f"allow_patterns = {q(pair.allow_patterns)}",
        f"ignore_patterns = {q(pair.ignore_patterns)}",
    ]
    for table, g in (("target", pair.gguf_target), ("draft", pair.gguf_draft)):
        if g is not None:
            lines += ["", f"[llamacpp.{table}]", f"repo = {q(g.repo)}", f"revision = {q(g.revision)}"]
            lines += [f"filename = {q(g.filename)}", f"quant = {q(g.quant)}", f"size_gb = {q(g.size_gb)}"]
    return "\n".join(lines) + "\n"


def _check(target: Path, draft: Path) -> tuple[tuple[str, ...] | None, str]:
    """(warnings, "") when the pair check passes, (None, why) when it fails."""
    from ssdlocal.weights.compat import check_paths

    try:
        return check_paths(target, draft).warnings, ""
    except IncompatiblePairError as exc:
        return None, exc.message
    except Exception as exc:  # noqa: BLE001 - a repository's files are anyone's: unreadable is a failure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"its tokenizer cannot be read: {type(exc).__name__} {first}".rstrip()


def _drop(repo: str, ours: bool, sel: Selection) -> None:
    """Remove what was fetched of a draft that failed the pair check: its repository's
    folder when nothing of it was here before, else a GGUF file fetched for it."""
    entry = cache.hub_entry(repo)
    if entry is None:
        return
    snapshot = entry.path / "snapshots" / sel.commit / (sel.gguf or "")
    if sel.gguf is not None and snapshot.exists():
        cache.remove_hub_file(snapshot)  # with the metadata the pair check built from it
    if ours:
        cache.remove(entry)


def pull_model(plan: PullPlan, say: Callable[[str], None], *, update: bool = False) -> PulledModel:
    """Download the target, then drafts in the plan's order until one passes the pair
    check; write the pair file. `say(line)` reports each draft tried."""
    from ssdlocal.core.files import atomic_write_text
    from ssdlocal.weights import hub

    file = user_dir() / f"{plan.name}.toml"
    backend = BackendName.LLAMACPP if plan.target.gguf else BackendName.TORCH
    retry = str(plan.spec)
    alone = to_pair(dataclasses.replace(plan, draft=None), file)
    target = hub.pull(alone, backend, update=update, retry=retry).target
    draft, warnings = None, ()
    while plan.draft is not None:
        pair, repo = to_pair(plan, file), plan.draft.repo
        ours = cache.hub_entry(repo) is None  # nothing of it was here: a failure removes all of it
        if plan.draft.gguf is None:  # its tokenizer first: a draft that fails is not fetched whole
            tokenizer = hub.fetch_files(pair, plan.draft, TOKENIZER_FILES, retry)
            found, why = _check(target, tokenizer)
        else:
            got = hub.pull(pair, backend, update=update, retry=retry)
            found, why = _check(target, got.draft)  # type: ignore[arg-type]
        if found is not None:
            if plan.draft.gguf is None:  # the safetensors draft's weights, now that it passed
                got = hub.pull(pair, backend, update=update, retry=retry)
            draft, warnings = got.draft, found
            break
        _drop(repo, ours, plan.draft)
        say(f"draft {repo} fails the pair check ({why})" + ("; what was fetched of it is removed" if ours else ""))
        next_draft(plan)
    pair = to_pair(plan, file)
    file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(file, pair_toml(pair, plan.spec))
    return PulledModel(pair, file, target, draft, warnings)
