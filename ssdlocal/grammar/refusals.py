"""What a grammar is refused for before any engine sees it: `GrammarError` (with the reason
a server reports), regexes whose counted repetitions expand past what the lexer builds, and
JSON schemas nested too deeply or whose `$ref`s loop without a value. Pure Python: no
llguidance, no torch.
"""

from __future__ import annotations

from typing import Any

from ssdlocal.core.errors import UsageError


class GrammarError(UsageError):
    """A grammar that cannot be enforced. `reason`: "invalid" (not a valid schema / regex /
    grammar), "unsupported" (valid, but uses features the engine cannot enforce), "too_slow"
    (over the compile time limit, or too complex for the engine), "too_large" (over a size
    bound) or "busy" (too many compiles already running and waiting: try again)."""

    def __init__(self, message: str, hint: str = "", reason: str = "invalid") -> None:
        super().__init__(message, hint)
        self.reason = reason


MAX_REGEX_EXPANSION = 100_000  # a regex's size with counted repetitions written out (the lexer builds them)


def regex_expansion(pattern: str) -> int | None:
    """The size of `pattern` with its counted repetitions written out: a{1,100} counts 100,
    (a{1,100}){1,100} 10,000 (unbounded loops count once). The engine's lexer builds such
    expressions as the answer goes, and gives up mid-answer past its own bound, so a
    pattern far beyond it is refused at compile time. None: Python cannot read the
    pattern (the engine decides)."""
    try:
        from re import _parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    try:
        parsed = sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 - ECMA syntax Python lacks: not ours to judge
        return None
    unbounded = sre_parse.MAXREPEAT

    def size(items) -> int:
        total = 0
        for op, arg in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, sub = arg
                total += (high if high != unbounded else max(low, 1)) * size(sub)
            elif name == "SUBPATTERN":
                total += size(arg[-1])
            elif name in ("ATOMIC_GROUP",):
                total += size(arg)
            elif name == "BRANCH":
                total += sum(size(b) for b in arg[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(arg[1])
            else:
                total += 1
            if total > 10 * MAX_REGEX_EXPANSION:
                return total  # far enough: stop counting
        return total

    return size(parsed)


def check_regex(pattern: str, what: str = "regex") -> None:
    """GrammarError for a pattern whose written-out size passes MAX_REGEX_EXPANSION."""
    size = regex_expansion(pattern)
    if size is not None and size > MAX_REGEX_EXPANSION:
        raise GrammarError(
            f"the {what} {pattern[:60]!r}{'...' if len(pattern) > 60 else ''} is too complex to enforce: its "
            f"counted repetitions expand to more than {MAX_REGEX_EXPANSION:,} parts",
            "use smaller repetition counts, or fewer nested ones",
            reason="too_slow",
        )


MAX_SCHEMA_DEPTH = 100  # nested objects and lists in a schema's JSON (the engine's parser stops near 128)


def check_schema_shape(schema: Any) -> None:
    """GrammarError for a schema the engine would refuse with a vague message: not an
    object, nested deeper than MAX_SCHEMA_DEPTH, or whose `$ref`s form a cycle that never
    reaches a value (e.g. a -> b -> a)."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object", 'send {"type": "object", ...}')
    depth, stack = 0, [(schema, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(
                f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and lists)",
                "flatten it, or describe the deep part with a $ref to a definition",
                reason="too_large",
            )
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    stack = [schema]
    while stack:  # every string pattern
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], "pattern")
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    cycle = _ref_cycle(schema)
    if cycle:
        raise GrammarError(
            f"the JSON schema's references form a cycle that never reaches a value: {' -> '.join(cycle)}",
            "let one of them define a value (a type, properties, ...) besides its $ref",
        )


def _ref_cycle(schema: dict) -> list[str]:
    """A chain of local `$ref`s (JSON pointers "#/...") that comes back to where it started
    without passing a schema of its own (only a $ref), else []."""

    def resolve(ref: str):
        if not ref.startswith("#"):
            return None
        node: Any = schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    refs, stack = [], [schema]
    while stack:  # every $ref in the schema
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    for start in dict.fromkeys(refs):
        chain, ref = [start], start
        while True:
            target = resolve(ref)
            only_ref = (
                isinstance(target, dict)
                and isinstance(target.get("$ref"), str)
                and not (set(target) - {"$ref", "$defs", "definitions", "description", "title", "$comment"})
            )
            if not only_ref:
                break
            ref = target["$ref"]
            if ref in chain:
                return chain[chain.index(ref) :] + [ref]
            chain.append(ref)
    return []
