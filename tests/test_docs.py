"""The docs name only what exists: every repository path written in README.md or docs/*.md
(`ssdlocal/...`, `scripts/...`, `tests/...`, `docs/...`, `models/...`, or a module written
relative to the package such as `backends/torch/runner.py` or `cli/resolve.parse_draft`)
is a file or folder of this checkout, and a symbol named with its module (`module.name`,
or "`NAME` in `file.py`") is defined in that module; and every relative link lands on a file
and, with a `#section`, on one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ssdlocal"
TOP_DIRS = {"ssdlocal", "scripts", "tests", "docs", "models", ".ci"}
# a run of path characters with a slash, not part of a URL, a home path or a longer word
PATH = re.compile(r"(?<![\w./~:-])((?:\.ci|[A-Za-z_][\w-]*)/[\w.*/-]*[\w*/])")
SYMBOL_IN_FILE = re.compile(r"`([A-Za-z_]\w*)` in `([\w/]+\.py)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def package_dirs() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}


def named_paths(text: str) -> list[str]:
    """The repository paths a doc names. A word under a package folder counts only when it
    looks like a module or folder (`.py`, `module.symbol`, a trailing slash), so prose
    such as "draft/target ratio" is not a path."""
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".")
        head = path.split("/")[0]
        if head in TOP_DIRS or (head in package_dirs() and ("." in path or path.endswith("/"))):
            found.append(path)
    return found


def resolve(path: str) -> tuple[list[Path], str | None]:
    """The files `path` names (glob patterns allowed), tried from the repository root and
    from the package, and the symbol after a module (`cli/resolve.parse_draft`), if any."""
    candidates = [path]
    module, _, symbol = path.rpartition(".")
    if module and "/" in module and symbol.isidentifier() and symbol != "py" and not path.endswith("/"):
        candidates.append(module + ".py")
    for base in (ROOT, PACKAGE):
        for candidate in candidates:
            hits = sorted(base.glob(candidate)) if "*" in candidate else [base / candidate]
            hits = [hit for hit in hits if hit.exists()]
            if hits:
                return hits, (symbol if candidate != path else None)
    return [], None


def defines(path: Path, symbol: str) -> bool:
    text = path.read_text()
    return re.search(rf"^\s*(?:def|class|async def)\s+{symbol}\b|^\s*{symbol}\s*[:=]", text, re.M) is not None


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes for a Markdown file's headings (code blocks skipped):
    lower case, punctuation other than `-` and `_` dropped, spaces to hyphens."""
    text = FENCE.sub("", doc.read_text())
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in HEADING.findall(text)}


def test_every_link_between_the_docs_lands():
    """Relative links in README.md and docs/*.md point at files that exist, and a
    `#section` at a heading of that file (what moving text between docs breaks)."""
    broken, checked = [], 0
    for doc in doc_files():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            checked += 1
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert checked > 10, checked
    assert not broken, broken


def test_every_path_the_docs_name_exists():
    checked, missing = 0, []
    for doc in doc_files():
        for path in named_paths(doc.read_text()):
            checked += 1
            hits, symbol = resolve(path)
            if not hits:
                missing.append(f"{doc.name}: {path}")
            elif symbol and not defines(hits[0], symbol):
                missing.append(f"{doc.name}: {path} ({symbol} is not defined in {hits[0].relative_to(ROOT)})")
    assert checked > 50, checked  # the scan found the docs' paths at all
    assert not missing, missing


def test_every_symbol_named_in_a_file_is_defined_there():
    wrong = []
    for doc in doc_files():
        for symbol, path in SYMBOL_IN_FILE.findall(doc.read_text()):
            hits, _ = resolve(path)
            if not hits:
                hits = sorted(PACKAGE.rglob(path))
            if not any(defines(hit, symbol) for hit in hits):
                wrong.append(f"{doc.name}: `{symbol}` in `{path}`")
    assert not wrong, wrong


def test_the_scan_catches_stale_paths_and_symbols():
    """The checks above fail on what the issue found in an older architecture doc."""
    assert named_paths("see `backends/torch/kvpool.py`, the draft/target ratio, `~/.cache/ssdlocal/gguf`") == [
        "backends/torch/kvpool.py"
    ]
    assert resolve("backends/torch/kvpool.py") == ([], None)
    hits, symbol = resolve("cli/resolve.parse_draft")
    assert hits == [PACKAGE / "cli" / "resolve.py"] and symbol == "parse_draft" and defines(hits[0], symbol)
    assert "serving-openai-compatible" in anchors(ROOT / "docs" / "serving.md")
    assert "serving" not in anchors(ROOT / "README.md")  # the README keeps no server section
    factory = PACKAGE / "draft" / "factory.py"
    assert not defines(factory, "DRAFT_WORDS") and defines(PACKAGE / "cli" / "resolve.py", "DRAFT_WORDS")
