"""Grammars for constrained decoding, compiled with llguidance against one vocabulary.

`GrammarCompiler` turns a JSON schema, "any JSON object", a regular expression or Lark text
into a `Grammar`: validated (a schema using keywords llguidance cannot enforce is refused,
naming them; one nested too deeply or whose $refs loop, saying so), compiled within a
time limit (with a grammar.pool.CompilePool: first in a child process that is killed
past it), and cached (least recently used, bounded; a grammar the engine failed on while
answering stays cached as refused). A
Grammar is compiled once and copied per row (`Grammar.matcher()`). llguidance is imported
when the first grammar is asked for (pip extra `serve`), with an install hint when missing.
Knows nothing of models, rounds or HTTP.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ssdlocal.core.errors import UsageError
from ssdlocal.grammar.kinds import GrammarKind, GrammarSpec
from ssdlocal.grammar.refusals import GrammarError, check_regex, check_schema_shape

log = logging.getLogger(__name__)

WHITESPACE = r"( ?\r?\n[ \t]{0,32}| )?"  # between JSON tokens: a space, or a line break and its indentation
INSTALL_HINT = 'pip install llguidance (the "grammar" and "serve" extras include it)'


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one grammar may cost (the limits table in docs/hardening.md)."""

    max_chars: int = 65_536  # the grammar's text (a schema's JSON, a regex, Lark)
    compile_timeout_s: float = 5.0  # compile + the first mask
    cache_entries: int = 64  # compiled grammars kept
    compile_workers: int = 1  # compiles at a time (a server checks each in a child process: grammar/pool.py)
    compile_queue: int = 8  # compiles waiting for one; more are refused as busy


def require_llguidance(hf: bool = True):
    """The llguidance module, or UsageError with the install hint; `hf`: with its Hugging
    Face tokenizer adapter (which imports transformers)."""
    try:
        import llguidance

        if hf:
            import llguidance.hf  # noqa: F401 - the tokenizer adapter
    except ImportError:
        raise UsageError("constrained decoding needs llguidance, which is not installed", INSTALL_HINT) from None
    return llguidance


class Grammar:
    """One compiled grammar: a template matcher in its start state, copied per row."""

    def __init__(self, key: str, kind: GrammarKind, template, compile_s: float) -> None:
        self.key = key  # what it was compiled from (kind and text)
        self.kind = kind
        self._template = template  # llguidance.LLMatcher, never advanced
        self.compile_s = compile_s
        self.failed: str | None = None  # the engine could not continue an answer under it (its message)

    def matcher(self):
        """A fresh llguidance.LLMatcher in the start state (a copy: rows never share one)."""
        return self._template.deep_copy()

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {self.key[:60]!r})"


class GrammarCompiler:
    """Compiles grammars for one tokenizer (the target's) and caches them.

    `tokenizer`: a Hugging Face fast tokenizer; `vocab_size`: the model's vocabulary (may
    exceed the tokenizer's: padding rows are never allowed); `eos_ids`: the tokens that end
    a row, allowed once the grammar is complete. Building llguidance's view of the vocabulary
    takes a second or more, so it is built once, on the first grammar (or by `prepare`).
    Thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids, limits: GrammarLimits | None = None, pool=None) -> None:
        self.tokenizer = tokenizer
        self.pool = pool  # grammar.pool.CompilePool: compiles checked in killable children (None: a thread)
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.limits = limits or GrammarLimits()
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # the tokenizer view and the cache
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.hits = 0
        self.compiled = 0

    # ------------------------------------------------------------------ public
    def prepare(self) -> None:
        """Build llguidance's view of the vocabulary now (else on the first grammar)."""
        self._tokenizer()

    def json_schema(self, schema: Any) -> Grammar:
        """A grammar for JSON documents that validate against `schema` (a dict)."""
        check_schema_shape(schema)
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        return self._get(GrammarKind.JSON_SCHEMA, text)

    def json_object(self) -> Grammar:
        """A grammar for any JSON object."""
        return self._get(GrammarKind.JSON_OBJECT, '{"type":"object"}')

    def regex(self, pattern: str) -> Grammar:
        """A grammar for the strings that match `pattern` whole."""
        check_regex(pattern)
        return self._get(GrammarKind.REGEX, pattern)

    def lark(self, text: str) -> Grammar:
        """A grammar written in llguidance's Lark dialect (may embed `%json {schema}`)."""
        return self._get(GrammarKind.LARK, text)

    def compile(self, grammar: GrammarSpec) -> Grammar:
        """The Grammar of `grammar`, by the method of its kind (json_schema, json_object, ...)."""
        build = {GrammarKind.JSON_SCHEMA: self.json_schema, GrammarKind.REGEX: self.regex, GrammarKind.LARK: self.lark}
        return self.json_object() if grammar.kind is GrammarKind.JSON_OBJECT else build[grammar.kind](grammar.source)

    def special_token(self, text: str) -> int | None:
        """The id of `text` when the vocabulary has it as one added token (such tokens are
        written `<[id]>` in Lark: llguidance does not match them as text), else None."""
        added = getattr(self.tokenizer, "get_added_vocab", lambda: {})()
        return added.get(text)

    # ------------------------------------------------------------------ compile
    def _get(self, kind: GrammarKind, text: str) -> Grammar:
        if len(text) > self.limits.max_chars:
            raise GrammarError(
                f"the {kind.words} has {len(text)} characters; at most {self.limits.max_chars} are allowed",
                "send a smaller schema",
                reason="too_large",
            )
        key = f"{kind}:{text}"
        with self._lock:
            found = self._cache.get(key)
            if found is not None and found.failed is not None:  # its lexer gave up on an earlier answer
                raise GrammarError(
                    f"the {kind.words} is too complex to enforce: an earlier answer "
                    f"under it stopped with: {found.failed}",
                    "simplify it",
                    reason="too_slow",
                )
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        if self.pool is None:
            grammar = self._compile_bounded(kind, text, key)
        else:
            ll_tokenizer = self._tokenizer()  # llguidance and the vocabulary: their errors are ours, not a child's
            with self.pool.slot(self.limits.compile_timeout_s):
                with self._lock:
                    found = self._cache.get(key)  # compiled while this one waited
                if found is not None:
                    return found
                self.pool.check(kind, text, self.limits.compile_timeout_s)  # killed past the limit
                grammar = self._compile(kind, text, key, ll_tokenizer)  # the same work: it fits too
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.limits.cache_entries:
                self._cache.popitem(last=False)
            self.compiled += 1
        return grammar

    def _compile_bounded(self, kind: GrammarKind, text: str, key: str) -> Grammar:
        """Compile in a thread of its own; past the time limit, GrammarError (the thread
        finishes on its own: llguidance bounds its work by fuel, and drops the GIL)."""
        ll_tokenizer = self._tokenizer()  # not counted against the limit: built once
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["grammar"] = self._compile(kind, text, key, ll_tokenizer)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=work, name="ssdlocal-grammar", daemon=True)
        thread.start()
        thread.join(self.limits.compile_timeout_s)
        if thread.is_alive():
            raise GrammarError(
                f"the {kind.words} did not compile within {self.limits.compile_timeout_s:g} s",
                "simplify it (fewer alternatives, smaller repetition counts)",
                reason="too_slow",
            )
        if "error" in result:
            raise result["error"]
        return result["grammar"]

    def _compile(self, kind: GrammarKind, text: str, key: str, ll_tokenizer) -> Grammar:
        kind = GrammarKind.parse(kind, "grammar kind")  # a compile child receives it over a pipe
        llg = require_llguidance(hf=False)
        t0 = time.perf_counter()
        source = self._source(llg, kind, text)
        limits = llg.LLParserLimits(verbose_errors=False)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, ll_tokenizer, limits=limits)
        if is_error:
            raise _refusal(kind, messages[0] if messages else "unknown error")
        if messages:
            log.debug("grammar warnings for %s: %s", kind, messages)
        template = llg.LLMatcher(ll_tokenizer, source, log_level=0, limits=limits)
        if template.is_error():
            raise _refusal(kind, template.get_error())
        first_mask(template, self.vocab_size)  # builds the lexer: the rest of the compile work
        if template.is_error():
            raise _refusal(kind, template.get_error())
        return Grammar(key, kind, template, time.perf_counter() - t0)

    @staticmethod
    def _source(llg, kind: GrammarKind, text: str) -> str:
        # the model's own JSON layout (compact, spaced or indented), bounded so that
        # whitespace cannot run on
        options = {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}
        if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
            try:
                return llg.LLMatcher.grammar_from_json_schema(text, defaults=options)
            except ValueError as exc:
                raise GrammarError(f"not a valid JSON schema: {_short(str(exc))}") from None
        if kind is GrammarKind.REGEX:
            return llg.LLMatcher.grammar_from_regex(text)
        return llg.LLMatcher.grammar_from_lark(text)

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = require_llguidance()
                t0 = time.perf_counter()
                tokens = len(self.tokenizer)
                if tokens > self.vocab_size:  # llguidance: "vocab size too small"
                    where = getattr(self.tokenizer, "name_or_path", "") or "the model's directory"
                    raise UsageError(
                        f"the model's tokenizer has {tokens} tokens but its config's vocab_size is {self.vocab_size}, "
                        "so grammars cannot be enforced for it",
                        f"the model files disagree: check vocab_size in config.json against tokenizer.json "
                        f"(and added_tokens) in {where}",
                    )
                self._ll_tokenizer = llg.LLTokenizer(
                    vocabulary_json(self.tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
                log.info("grammar engine ready for %d tokens in %.1f s", self.vocab_size, time.perf_counter() - t0)
            return self._ll_tokenizer


def vocabulary_json(tokenizer) -> str:
    """A Hugging Face fast tokenizer's own JSON (added tokens included; no padding or
    truncation), as llguidance builds its vocabulary view from it (llguidance.hf does the
    same; this lets a child process build the view without transformers)."""
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise UsageError(
            "constrained decoding needs a fast (Rust) Hugging Face tokenizer",
            "use a model directory with tokenizer.json",
        )
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def check(grammar: GrammarSpec) -> None:
    """Refuse a grammar that cannot compile, before any model is loaded (no vocabulary
    needed): GrammarError as `compile` would raise it."""
    llg = require_llguidance()
    kind, source = grammar.kind, {"type": "object"} if grammar.kind is GrammarKind.JSON_OBJECT else grammar.source
    text = source if kind in (GrammarKind.REGEX, GrammarKind.LARK) else json.dumps(source, ensure_ascii=False)
    if kind is GrammarKind.JSON_SCHEMA:
        check_schema_shape(source)
    elif kind is GrammarKind.REGEX:
        check_regex(source)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        GrammarCompiler._source(llg, kind, text), None, limits=llg.LLParserLimits(verbose_errors=False)
    )
    if is_error:
        raise _refusal(kind, messages[0] if messages else "unknown error")


def first_mask(matcher, vocab_size: int):
    """The allowed-token bitmask of `matcher`'s current state: int32 words [ceil(V/32)]
    (a ctypes array: compiling needs no torch, so a compile's child process stays small)."""
    import ctypes

    words = (ctypes.c_int32 * ((vocab_size + 31) // 32))()
    matcher.unsafe_compute_mask_ptr(ctypes.addressof(words), ctypes.sizeof(words))
    return words


def _refusal(kind: GrammarKind, message: str) -> GrammarError:
    """llguidance's message as a GrammarError: unsupported features named as such."""
    message = _short(message)
    what = kind.words
    if "Unimplemented" in message or "not supported" in message.lower() or "unsupported" in message.lower():
        return GrammarError(
            f"the {what} uses features ssdlocal's grammar engine cannot enforce: {message}",
            "drop those keywords (or enforce them after the answer arrives)",
            reason="unsupported",
        )
    if "limit" in message.lower() or "too complex" in message.lower() or "fuel" in message.lower():
        return GrammarError(f"the {what} is too complex to enforce: {message}", "simplify it", reason="too_slow")
    return GrammarError(f"invalid {what}: {message}", "check it against its specification")


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
