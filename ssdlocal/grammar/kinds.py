"""What a grammar is written in (`GrammarKind`) and what one is compiled from (`GrammarSpec`).

Made where the user's grammar enters (the CLI's --json-schema / --regex, the server's
response_format and forced tool calls) and handed to grammar.compiler, which compiles a
GrammarSpec and knows no other spelling of a kind. Knows nothing of llguidance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ssdlocal.core.choice import Choice
from ssdlocal.core.errors import UsageError


class GrammarKind(Choice):
    """A JSON schema (a dict), any JSON object (no source), a regular expression matched
    whole, or llguidance's Lark dialect (text)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    LARK = "lark"

    @property
    def words(self) -> str:
        """The kind for people: "json schema", "regex", ..."""
        return self.value.replace("_", " ")


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar to compile: its kind and its source (a dict for JSON_SCHEMA, text for
    REGEX and LARK, None for JSON_OBJECT). A kind given as text is parsed (UsageError with
    the choices when unknown); REGEX or LARK source that is not text raises UsageError
    (a schema's shape is grammar.compiler's to check)."""

    kind: GrammarKind
    source: Any = None

    def __post_init__(self) -> None:
        kind = GrammarKind.parse(self.kind, "grammar kind")
        object.__setattr__(self, "kind", kind)
        if kind in (GrammarKind.REGEX, GrammarKind.LARK) and not isinstance(self.source, str):
            raise UsageError(
                f"a {kind.words} grammar is text, got {type(self.source).__name__}",
                f"pass the {kind.words} as a string",
            )
