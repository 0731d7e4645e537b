"""llguidance vs xgrammar on the built-in pair's vocabulary: what the choice of grammar engine rests on.

    pip install llguidance xgrammar      # xgrammar: `--no-deps` plus apache-tvm-ffi avoids its triton
    python scripts/archive/grammar_engines.py [--tokenizer GGUF] [--out results.json]

The Qwen2.5-Coder tokenizer (151,936 tokens, read from the GGUF; nothing is changed there).
For each grammar (any JSON object, a nested schema, a forced tool call in the Hermes format):
  - compile: from the grammar's text to the first mask (llguidance builds its lexer lazily, so
    its first mask carries that work);
  - mask per token: a speculative walk over a real answer, K=4 drafts per round: a mask at
    every drafted position and after it, the rejected drafts rolled back (acceptance 75%);
  - rollback and copy (fork / deep_copy) of a matcher's state;
and which schema keywords each refuses rather than ignores, and how long a pathological regex
takes to compile. Prints one JSON object (medians in microseconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


GGUF = Path("~/.cache/ssdlocal/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf").expanduser()
V = 151936
K = 4
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TEXTS = {
    "json_object": json.dumps(
        {
            "files": [
                {"path": "src/main.py", "lines": 120, "language": "python"},
                {"path": "README.md", "lines": 40, "language": "markdown"},
            ],
            "ok": True,
        },
        indent=2,
    ),
    "schema": json.dumps(
        {
            "name": "Ada Lovelace",
            "age": 36,
            "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "12345"},
        },
        indent=2,
    ),
    "tool_call": "<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}})
    + "\n</tool_call>",
}
FEATURES = {
    "not": {"type": "object", "not": {"required": ["a"]}},
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "if/then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
}
PATHOLOGICAL = {"type": "string", "pattern": "^(a|b|c){1,5000}x(a|b){2000}$"}


def walk(ids, fill, accept, rollback, seed=0):
    """Masks along K drafts per round, roll back the rejected, commit the bonus: seconds per fill."""
    rnd, i, fills, rollbacks = random.Random(seed), 0, [], []
    while i < len(ids):
        drafts = ids[i : i + K]
        for d in drafts:
            t = time.perf_counter()
            fill()
            fills.append(time.perf_counter() - t)
            accept(d)
        t = time.perf_counter()
        fill()
        fills.append(time.perf_counter() - t)
        n = 0
        while n < len(drafts) and rnd.random() < 0.75:
            n += 1
        t = time.perf_counter()
        if len(drafts) > n:
            rollback(len(drafts) - n)
        rollbacks.append(time.perf_counter() - t)
        i += n
        if i < len(ids):
            accept(ids[i])
            i += 1
    return fills, rollbacks


def summary(compile_s, fills, rollbacks, copy_s, tokens):
    us = lambda x: round(x * 1e6, 1)  # noqa: E731
    return {
        "tokens": tokens,
        "compile_ms": round(compile_s * 1e3, 2),
        "mask_us_median": us(statistics.median(fills)),
        "mask_us_mean": us(statistics.mean(fills)),
        "mask_us_p99": us(sorted(fills)[int(0.99 * (len(fills) - 1))]),
        "rollback_us_mean": us(statistics.mean(rollbacks)),
        "copy_us": us(copy_s),
    }


def run_llguidance(tok) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=[151643, 151645])
    out = {
        "version": llguidance.get_version() if hasattr(llguidance, "get_version") else "?",
        "vocabulary_setup_s": round(time.perf_counter() - t0, 2),
    }
    options = {"whitespace_flexible": True}
    for name, text in TEXTS.items():
        ids = tok.encode(text, add_special_tokens=False)
        t0 = time.perf_counter()
        if name == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        elif name == "schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults=options)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                'start: <[151657]> "\\n" call "\\n" <[151658]>\ncall: %json ' + json.dumps(CALL)
            )
        matcher = llguidance.LLMatcher(ltok, grammar, log_level=0)
        mask = lt.allocate_token_bitmask(1, V)
        lt.fill_next_token_bitmask(matcher, mask, 0)
        compile_s = time.perf_counter() - t0
        fills, rollbacks = walk(
            ids, lambda: lt.fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token, matcher.rollback
        )
        assert not matcher.is_error(), matcher.get_error()
        t0 = time.perf_counter()
        matcher.deep_copy()
        out[name] = summary(compile_s, fills, rollbacks, time.perf_counter() - t0, len(ids))
    refused = {}
    for feature, schema in FEATURES.items():
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema), ltok
        )
        refused[feature] = messages[0][:80] if is_error else "accepted (not enforced)"
    out["unsupported_keywords"] = refused
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(PATHOLOGICAL), log_level=0)
    lt.fill_next_token_bitmask(matcher, lt.allocate_token_bitmask(1, V), 0)
    out["pathological_regex_compile_s"] = round(time.perf_counter() - t0, 3)
    return out


def run_xgrammar(tok) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    out = {"version": getattr(xgr, "__version__", "?"), "vocabulary_setup_s": round(time.perf_counter() - t0, 2)}
    for name, text in TEXTS.items():
        ids = tok.encode(text, add_special_tokens=False)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        t0 = time.perf_counter()
        if name == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        elif name == "schema":
            compiled = compiler.compile_json_schema(json.dumps(PERSON))
        else:
            compiled = compiler.compile_grammar(
                xgr.Grammar.concat(
                    xgr.Grammar.from_regex(r"<tool_call>\n"),
                    xgr.Grammar.from_json_schema(json.dumps(CALL)),
                    xgr.Grammar.from_regex(r"\n</tool_call>"),
                )
            )
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, V)
        matcher.fill_next_token_bitmask(mask, 0)
        compile_s = time.perf_counter() - t0
        fills, rollbacks = walk(
            ids, lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token, matcher.rollback
        )
        t0 = time.perf_counter()
        matcher.fork()
        out[name] = summary(compile_s, fills, rollbacks, time.perf_counter() - t0, len(ids))
    refused = {}
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    for feature, schema in FEATURES.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
            refused[feature] = "accepted (not enforced)"
        except Exception as exc:  # noqa: BLE001 - reported as what it said
            refused[feature] = str(exc)[:80]
    out["unsupported_keywords"] = refused
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(PATHOLOGICAL))
    out["pathological_regex_compile_s"] = round(time.perf_counter() - t0, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(GGUF), help="a GGUF (its tokenizer is read) or a tokenizer dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from ssdlocal.backends.registry import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    results = {}
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            results[name] = run(tok)
        except ImportError as exc:
            results[name] = {"skipped": f"not installed ({exc})"}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
