"""Benchmark prompt sets: the packaged default, JSONL files, or plain text files.

A prompt set is a list of BenchPrompt(id, kind, prompt). `select` takes the first N
round-robin over kinds, so a small --limit still covers code, math, instruction and chat.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ssdlocal.core.errors import UsageError

DEFAULT_SET = "ssdlocal/data/prompts.jsonl"
WORKLOADS = {  # packaged prompt sets, by name (--prompts NAME)
    "chat": "data/prompts.jsonl",  # code, math, instruction and chat requests (the default)
    "edit": "data/edit.jsonl",  # code edits that re-emit the code they are given, and
    # multi-turn sessions whose later turns change the code an earlier answer wrote
    "session": "data/session.jsonl",  # conversations over a source file in the system
    # message: each turn re-sends the history (what prefix reuse serves)
}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    kind: str
    prompt: str
    session: str | None = None  # turns of one conversation share a session id
    turn: int = 0  # 1, 2, ... within its session: the prompt follows the earlier turns' answers
    system: str | None = None  # a session's system message (on its first turn)


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Read a prompt set: None = the packaged default ("chat"); a workload name (WORKLOADS);
    a `.jsonl` file (or any file whose first non-blank line is a JSON object) of {"id",
    "kind", "prompt"} (and "session", "turn", "system" for conversations); else plain text, one prompt
    per non-blank line. Raises UsageError on a missing, empty or bad file."""
    if path is None or str(path) in WORKLOADS:
        name = WORKLOADS[str(path or "chat")]
        text = resources.files("ssdlocal").joinpath(name).read_text("utf-8")
        return _parse_jsonl(text.splitlines(), f"ssdlocal/{name}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(
            f"prompt file not found: {p}",
            f"pass --prompts {' or '.join(WORKLOADS)} (packaged workloads), or a FILE with one prompt "
            'per line, or JSONL lines of {"id", "kind", "prompt"}',
        )
    try:
        lines = p.read_text("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read prompt file {p}: {exc}", "pass a UTF-8 text or JSONL file") from None
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if not first:
        raise UsageError(f"prompt file {p} has no prompts", "write one prompt per line")
    if p.suffix == ".jsonl" or first.startswith("{"):
        return _parse_jsonl(lines, str(p))
    return [BenchPrompt(f"p{i + 1:02d}", "text", ln.strip()) for i, ln in enumerate(ln for ln in lines if ln.strip())]


def _parse_jsonl(lines: list[str], where: str) -> list[BenchPrompt]:
    out: list[BenchPrompt] = []
    hint = 'each line must be a JSON object like {"id": "code-01", "kind": "code", "prompt": "..."}'
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}:{number}: not valid JSON ({exc.msg})", hint) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UsageError(f'{where}:{number}: missing a non-empty "prompt" string', hint)
        session, turn = obj.get("session"), obj.get("turn", 0)
        if session is not None and (not isinstance(turn, int) or turn < 1):
            raise UsageError(f'{where}:{number}: a "session" prompt needs a "turn" of 1 or more', hint)
        system = obj.get("system")
        if system is not None and (session is None or not isinstance(system, str)):
            raise UsageError(f'{where}:{number}: "system" is a string, on a "session" prompt', hint)
        out.append(
            BenchPrompt(
                str(obj.get("id", f"p{len(out) + 1:02d}")),
                str(obj.get("kind", "text")),
                obj["prompt"],
                None if session is None else str(session),
                turn,
                system,
            )
        )
    if not out:
        raise UsageError(f"{where} has no prompts", hint)
    return out


def select(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first `limit` prompts taken round-robin over kinds (in order of first
    appearance); all prompts, round-robin ordered, when limit is None. A session's turns
    keep their order (a later turn is never taken without the earlier ones)."""
    if limit is not None and limit < 1:
        raise UsageError(f"limit must be >= 1, got {limit}", "use --limit 4, or omit it for all prompts")
    by_kind: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    queues = list(by_kind.values())
    ordered: list[BenchPrompt] = []
    depth = 0
    while len(ordered) < len(prompts):
        for q in queues:
            if depth < len(q):
                ordered.append(q[depth])
        depth += 1
    return ordered if limit is None else ordered[:limit]
