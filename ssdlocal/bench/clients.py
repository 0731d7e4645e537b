"""What each kind of concurrent client sends: an agent loop with tools, an editor's
fill-in-the-middle completions, a multi-turn streaming chat.

A client is a small state machine over OpenAI request bodies: `request()` gives the next
(path, body), `observe(reply)` folds the streamed answer back in (the agent appends its
calls and their tool answers, the chat its answer and the next question). Texts come from
the packaged prompt sets (ssdlocal/data/*.jsonl) and the small built-in tables below;
nothing here touches the network or knows which server answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ssdlocal.bench.prompts import load_prompts
from ssdlocal.core.config import SamplingParams

KINDS = ("agent", "fim", "chat")  # --clients N takes them round-robin

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite (or one test file) and return its output.",
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a string.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to inspect files and run tests; "
    "call one tool at a time and answer briefly once you know the fix."
)
AGENT_TASKS = (
    "tests/test_cart.py::test_total fails with an off-by-one. Find the cause and propose a fix.",
    "Add a --verbose flag to cli.py and make sure the tests still pass.",
    "The function parse_date in utils.py crashes on '2024-02-30'. Find out why and fix it.",
)
# the tool answers an agent's harness hands back, by tool name (the same every time)
TOOL_ANSWERS = {
    "read_file": "def total(items):\n    s = 0\n    for i in range(len(items) - 1):\n        s += items[i].price\n    return s\n",
    "run_tests": "FAILED tests/test_cart.py::test_total - assert 30 == 60\n1 failed, 12 passed in 0.41s",
    "search_code": "cart.py:12: def total(items):\ntests/test_cart.py:8:     assert total(cart) == 60",
}
CHAT_FOLLOW_UPS = ("Can you make that shorter?", "Give one concrete example.", "What would you test first?")
FIM_MIN_LINES = 5  # a snippet needs lines before and after the cursor


@dataclass
class Reply:
    """One streamed answer as the client saw it (filled by bench/stream.py)."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # [{"id", "type", "function": {"name", "arguments"}}]
    finish_reason: str | None = None


def sampling_fields(params: SamplingParams) -> dict:
    """The request fields every client sends: the bench's sampling settings and token cap."""
    body = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.max_new_tokens is not None:
        body["max_tokens"] = params.max_new_tokens
    if params.ignore_eos:
        body["ignore_eos"] = True  # ssdlocal and llama.cpp's own server read it; others ignore it
    return body


class AgentClient:
    """A tool-using agent: `steps` chat completions per task, each after the tool answers of
    the previous one; an answer without calls gets the harness's test run as a user turn."""

    kind = "agent"

    def __init__(self, index: int, common: dict, steps: int = 3) -> None:
        self.index, self.common, self.steps = index, common, steps
        self.task = index
        self._new_task()

    def _new_task(self) -> None:
        task = AGENT_TASKS[self.task % len(AGENT_TASKS)]
        self.messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}]
        self.step = 0

    def request(self) -> tuple[str, dict]:
        body = {**self.common, "messages": list(self.messages), "tools": TOOLS}
        return "/v1/chat/completions", body

    def observe(self, reply: Reply) -> None:
        self.step += 1
        if reply.tool_calls:
            self.messages.append({"role": "assistant", "content": reply.text or None, "tool_calls": reply.tool_calls})
            for call in reply.tool_calls:
                name = call["function"]["name"]
                answer = TOOL_ANSWERS.get(name, f"error: no tool named {name!r}")
                self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": answer})
        else:
            self.messages.append({"role": "assistant", "content": reply.text})
            self.messages.append({"role": "user", "content": "Output of run_tests:\n" + TOOL_ANSWERS["run_tests"]})
        if self.step >= self.steps:
            self.task += 1
            self._new_task()


class FimClient:
    """An editor completing at the cursor: `/v1/completions` with the code before the cursor
    as `prompt` and the code after it as `suffix`, one snippet and cursor after another."""

    kind = "fim"

    def __init__(self, index: int, common: dict) -> None:
        self.common = common
        self.snippets = code_snippets()
        self.n = index  # clients of this kind start at different snippets

    def request(self) -> tuple[str, dict]:
        lines = self.snippets[self.n % len(self.snippets)].splitlines(keepends=True)
        cursor = 2 + (self.n * 3) % (len(lines) - 3)  # a line inside the snippet, removed as the gap
        body = {**self.common, "prompt": "".join(lines[:cursor]), "suffix": "".join(lines[cursor + 1 :])}
        return "/v1/completions", body

    def observe(self, reply: Reply) -> None:
        self.n += 1


class ChatClient:
    """A person chatting: a packaged chat/instruction prompt, then follow-up questions, each
    turn re-sending the conversation; a new conversation after `turns` turns."""

    kind = "chat"

    def __init__(self, index: int, common: dict, turns: int = 3) -> None:
        self.common, self.turns = common, turns
        self.openers = [p.prompt for p in load_prompts("chat") if p.kind in ("chat", "instruction")]
        self.n = index
        self._new_conversation()

    def _new_conversation(self) -> None:
        self.messages = [{"role": "user", "content": self.openers[self.n % len(self.openers)]}]
        self.turn = 0

    def request(self) -> tuple[str, dict]:
        return "/v1/chat/completions", {**self.common, "messages": list(self.messages)}

    def observe(self, reply: Reply) -> None:
        self.messages.append({"role": "assistant", "content": reply.text})
        self.messages.append({"role": "user", "content": CHAT_FOLLOW_UPS[self.turn % len(CHAT_FOLLOW_UPS)]})
        self.turn += 1
        if self.turn >= self.turns:
            self.n += 1
            self._new_conversation()


CLIENTS = {"agent": AgentClient, "fim": FimClient, "chat": ChatClient}


def make_clients(count: int, params: SamplingParams, model: str) -> list:
    """`count` clients, kinds round-robin (agent, fim, chat, agent, ...), all sending `model`."""
    common = {"model": model, **sampling_fields(params)}
    return [CLIENTS[KINDS[i % len(KINDS)]](i // len(KINDS), dict(common)) for i in range(count)]


def code_snippets() -> list[str]:
    """Python code blocks of the packaged edit workload long enough to cut at a cursor."""
    blocks = []
    for p in load_prompts("edit"):
        for block in re.findall(r"```python\n(.*?)```", p.prompt, flags=re.S):
            if block.count("\n") >= FIM_MIN_LINES and block not in blocks:
                blocks.append(block)
    return blocks
