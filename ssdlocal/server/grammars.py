"""A request's grammar: its JSON response format or forced tool call, compiled for the
served model.

One `RequestGrammars` per server holds one grammar.compiler.GrammarCompiler (llguidance's
view of the vocabulary is built once, in the background from start-up; compiled grammars
are cached and bounded) and the tool-call format of the model's chat template. `for_request`
returns the Grammar that enforces what a request asks for (a list of several forced calls
wrapped in calllist.CallList, which ends it at a repeated call), or None, and turns every refusal
into OpenAI's error body naming the field: an invalid schema, features the grammar engine
cannot enforce (named), a schema over the size bound, a grammar over the compile time limit.
"""

from __future__ import annotations

import logging
import threading

from ssdlocal.core.errors import UsageError
from ssdlocal.grammar.compiler import GrammarCompiler, GrammarError, GrammarLimits
from ssdlocal.grammar.kinds import GrammarSpec
from ssdlocal.grammar.pool import CompilePool
from ssdlocal.server.calllist import CallList
from ssdlocal.server.protocol import APIError, ParsedRequest, bad
from ssdlocal.server.structured import FieldError
from ssdlocal.server.tools import ToolFormat, compile_forced, detect_format, require_format, several_calls

log = logging.getLogger(__name__)

CODES = {
    "unsupported": "unsupported_schema",
    "too_slow": "grammar_too_complex",
    "too_large": "schema_too_large",
    "busy": "grammar_compiles_busy",
}


class RequestGrammars:
    """Grammars for the requests of one server (thread-safe)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_ids,
        limits: GrammarLimits | None = None,
        isolate: bool = True,
        decoder=None,  # the engine thread's tokenizer (CallList decodes answers there); default `tokenizer`
    ) -> None:
        limits = limits or GrammarLimits()
        self.decoder = decoder if decoder is not None else tokenizer
        self.pool = (
            CompilePool(tokenizer, vocab_size, eos_ids, workers=limits.compile_workers, queue=limits.compile_queue)
            if isolate
            else None
        )
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, limits, self.pool)
        self.tool_format: ToolFormat | None = detect_format(getattr(tokenizer, "chat_template", None))
        self.ready = threading.Event()  # set once warm_up has finished

    def warm_up(self) -> None:
        """Build the vocabulary view, and start the compile children, in a background
        thread (skipped without llguidance); `wait_ready` waits for both."""

        def work() -> None:
            try:
                self.compiler.prepare()
                if self.pool is not None:
                    self.pool.start()
                    self.pool.wait_started()
            except UsageError as exc:  # llguidance missing, or a model it cannot serve
                log.debug("structured output is unavailable: %s", exc.message)
            except Exception:  # noqa: BLE001 - the first request will report it
                log.warning("the grammar engine could not be prepared", exc_info=True)
            finally:
                self.ready.set()

        threading.Thread(target=work, name="ssdlocal-grammar-prepare", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait for `warm_up` (a few CPU-seconds for a 150k-token vocabulary, which slow a
        prompt read on a small CPU when they overlap it): `serve` answers only after it."""
        return self.ready.wait(timeout_s)

    def tools_format(self, req: ParsedRequest) -> ToolFormat | None:
        """The format the request's tools are offered in (None: no tools offered)."""
        if not req.tools or req.tool_choice.mode == "none":
            return None
        try:
            return require_format(getattr(self.compiler.tokenizer, "chat_template", None))
        except FieldError as exc:
            raise bad(exc.message, param=exc.param, code="unsupported") from None

    def for_request(self, req: ParsedRequest):
        """The Grammar enforcing `req`'s response_format / forced tool call, or None."""
        fmt = self.tools_format(req)
        answer = req.response_format
        if not req.constrained:
            return None
        try:
            if fmt is not None and (req.tool_choice.forced or answer is not None):
                grammar = compile_forced(fmt, req.tools, req.tool_choice, self.compiler, answer)
                if not several_calls(fmt, req.tool_choice):
                    return grammar
                return CallList(grammar, fmt, req.tools, self.decoder, self.compiler.eos_ids)
            return self.compiler.compile(GrammarSpec(answer.kind, answer.schema))
        except FieldError as exc:
            raise bad(exc.message, param=exc.param, code="invalid_schema") from None
        except GrammarError as exc:
            param = (
                "response_format.json_schema.schema" if answer is not None and not req.tool_choice.forced else "tools"
            )
            if exc.reason == "busy":
                raise APIError(
                    503,
                    f"{exc.message} ({exc.hint})",
                    type="server_error",
                    param=param,
                    code=CODES["busy"],
                    headers={"Retry-After": "2"},
                ) from None
            raise APIError(
                400,
                f"{exc.message} ({exc.hint})" if exc.hint else exc.message,
                param=param,
                code=CODES.get(exc.reason, "invalid_schema"),
            ) from None
        except UsageError as exc:  # llguidance is not installed
            raise APIError(400, f"{exc.message} ({exc.hint})", param=_param(req), code="unsupported") from None


def _param(req: ParsedRequest) -> str:
    return "tool_choice" if req.tool_choice.forced else "response_format"
