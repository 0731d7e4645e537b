"""Fill-in-the-middle on the server: llama.cpp's `/infill` (what llama.vscode and llama.vim
call) and the FIM prompt of a completion that carries `suffix`.

`parse_infill` reads llama.cpp's body (`input_prefix`, `input_suffix`, `input_extra` =
[{filename, text}], `prompt`, `n_predict`, its sampling fields) into a `ParsedRequest`
with llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95; at temperature 0 the
last two are left off: they cannot change an argmax, and equal settings share batches);
fields that tune llama.cpp's own slots and timers are accepted and ignored, as llama.cpp
ignores fields it does not know. `InfillAnswer` builds
llama.cpp's answer: `content`, `stop`, `stop_type`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached` (prompt tokens the prefix cache held) and `timings`,
whole or as a stream of `{"content", "stop": false}` events ending with the full record.
`fim_ids` lays out the prompt (engine/fim.py) or refuses a model with no FIM tokens with
a 400 naming the field; `check_fim_chars` bounds the text a FIM request adds (suffix and
context files) like the prompt's. Knows nothing of HTTP frameworks or the engine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ssdlocal.core.sequence import FinishReason
from ssdlocal.engine.fim import ContextFile, FimTokens, fim_prompt, no_fim_error
from ssdlocal.server.protocol import APIError, ParsedRequest, bad, parse_completion
from ssdlocal.server.responses import grammar_failure
from ssdlocal.server.scheduler import Chunk, Finished

# llama.cpp's defaults for the fields a client leaves out
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
# llama.cpp field -> the OpenAI field it is parsed as (errors name the llama.cpp one)
_FIELDS = {
    "n_predict": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "stream": "stream",
    "ignore_eos": "ignore_eos",
    "return_tokens": "return_token_ids",
}
# our finish reasons in llama.cpp's /infill stop_type words
STOP_TYPES = {
    FinishReason.EOS: "eos",
    FinishReason.STOP: "word",
    FinishReason.LENGTH: "limit",
    FinishReason.CANCELLED: "none",
}


def parse_infill(body: Any, max_new_tokens: int | None, model: str) -> ParsedRequest:
    """A llama.cpp /infill body -> a FIM request for `model` (the served one: llama.cpp
    serves one model and takes no "model" field)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad(f"'{name}' must be a string", param=name)
        texts[name] = value or ""
    extra = _extra(body.get("input_extra"))
    openai: dict[str, Any] = {"model": model, "prompt": texts["input_prefix"] + texts["prompt"]}
    greedy = body.get("temperature") == 0  # top-k / top-p cannot change an argmax: left off
    for field, name in _FIELDS.items():
        value = body.get(field, None if greedy else DEFAULTS.get(field))
        if field == "n_predict" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            value = None  # -1: until end-of-sequence (within the server's cap)
        if field == "seed" and value == -1:
            value = None  # -1: a random seed
        if value is not None:
            openai[name] = value
    if openai.get("top_k") == 0:
        openai.pop("top_k")
    try:
        req = parse_completion({**openai, "suffix": texts["input_suffix"] or " "}, max_new_tokens)  # as FIM
    except APIError as exc:
        exc.param = {v: k for k, v in _FIELDS.items()}.get(exc.param, exc.param)
        if exc.param == "suffix":
            exc.param = "input_suffix"
        raise
    return replace(req, suffix=texts["input_suffix"], context_files=extra, repo_level=True)


def _extra(value: Any) -> tuple[ContextFile, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad('\'input_extra\' must be a list of {"filename", "text"} objects', param="input_extra")
    out = []
    for i, chunk in enumerate(value):
        if (
            not isinstance(chunk, dict)
            or not isinstance(chunk.get("text", ""), str)
            or not isinstance(chunk.get("filename", ""), str)
        ):
            raise bad(f'input_extra[{i}] must be {{"filename": string, "text": string}}', param="input_extra")
        out.append(ContextFile(chunk.get("filename") or "tmp", chunk.get("text") or ""))
    return tuple(out)


def check_fim_chars(req: ParsedRequest, limit: int) -> None:
    """A 400 when the prompts with the suffix and context files (each prompt's, for a FIM
    request) have more than `limit` characters (the server's --max-prompt-chars)."""
    if req.suffix is None:
        return
    each = len(req.suffix) + sum(len(c.filename) + len(c.text) for c in req.context_files)
    if sum(len(p) for p in req.prompts) + each * len(req.prompts) > limit:
        param = "input_suffix" if req.repo_level else "suffix"
        raise bad(
            f"the prompt, suffix and context files have more characters than this server's limit of "
            f"{limit:,} (--max-prompt-chars)",
            param=param,
            code="context_length_exceeded",
        )


def fim_ids(tokenizer, tokens: FimTokens | None, req: ParsedRequest, before: str, param: str) -> list[int]:
    """The FIM prompt of one prompt of `req`; a 400 naming `param` when the model has no
    FIM tokens."""
    if tokens is None:
        err = no_fim_error(param)
        raise bad(f"{err.message} ({err.hint})", param=param, code="unsupported")
    return fim_prompt(
        tokenizer, tokens, before, req.suffix or "", extra=req.context_files, repo_level=req.repo_level or None
    )


class InfillAnswer:
    """llama.cpp's /infill answer for one request (its first choice), whole or streamed.
    Same verbs as responses.Responses, so the route drives both alike."""

    def __init__(self, req: ParsedRequest, model: str, prompt_tokens: int, *, context: int = 0) -> None:
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.context = context

    def stream_chunks(self, item: Chunk) -> list[dict[str, Any]]:
        if item.choice != 0 or not (item.text or (self.req.return_token_ids and item.token_ids)):
            return []  # text held back (a partial character, a stop string's start)
        chunk: dict[str, Any] = {
            "index": 0,
            "content": item.text,
            "stop": False,
            "id_slot": 0,
            "tokens_evaluated": self.prompt_tokens,
        }
        if self.req.return_token_ids:
            chunk["tokens"] = list(item.token_ids)
        return [chunk]

    def failures(self, finished: Finished) -> list[APIError]:
        """The answered choice's grammar failure (finish_reason "error"), as an error: the
        whole answer is then that error, and a stream sends it after its last record."""
        return [grammar_failure(self.req, e) for e in finished.errors[:1] if e is not None]

    def finish_chunks(self, finished: Finished) -> list[dict[str, Any]]:
        """The stream's last event: the full record with empty content (llama.cpp's)."""
        return [{**self.complete(finished), "content": ""}]

    def complete(self, finished: Finished) -> dict[str, Any]:
        text, ids, reason = finished.choices[0]
        stats = finished.stats
        cached = finished.cached[0] if finished.cached else 0
        read = max(self.prompt_tokens - cached, 0)
        prompt_s = (
            read / stats["prefill_tokens_per_s"] if stats.get("prefill_tokens_per_s") else (stats.get("ttft_s") or 0.0)
        )
        rate = stats.get("tokens_per_s") or 0.0
        predicted_s = len(ids) / rate if rate else 0.0
        params = self.req.params
        return {
            "index": 0,
            "content": text,
            "tokens": list(ids) if self.req.return_token_ids else [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(ids),
            "tokens_evaluated": self.prompt_tokens,
            "tokens_cached": cached,
            "generation_settings": {
                "n_predict": -1 if params.max_new_tokens is None else params.max_new_tokens,
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
                "seed": params.seed,
                "stop": list(params.stop),
                "n_ctx": self.context,
            },
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": STOP_TYPES.get(reason, "none"),
            "stopping_word": "",
            "timings": {
                "prompt_n": read,
                "prompt_ms": prompt_s * 1e3,
                "prompt_per_token_ms": prompt_s * 1e3 / read if read else 0.0,
                "prompt_per_second": read / prompt_s if prompt_s else 0.0,
                "predicted_n": len(ids),
                "predicted_ms": predicted_s * 1e3,
                "predicted_per_token_ms": predicted_s * 1e3 / len(ids) if ids else 0.0,
                "predicted_per_second": rate,
            },
            "ssdlocal": stats,
        }
