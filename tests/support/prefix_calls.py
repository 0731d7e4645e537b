"""A sequence of calls that share prefixes (conversations over one long system message,
another conversation, a strict prefix, a divergence, a batch), for the prefix-cache tests:
`run_sequence` runs them on an engine and compares each with a fresh engine without the
cache."""

from __future__ import annotations

from ssdlocal.backends.prefix import BLOCK_TOKENS
from ssdlocal.core.config import SamplingParams
from ssdlocal.core.events import DoneEvent
from ssdlocal.engine import Engine

B = BLOCK_TOKENS


def prompt_ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 17 * i + (i * i) % 7) % 300 + 5 for i in range(n)]


SYSTEM = prompt_ids(1, 150)  # a long system message shared by every conversation


def conversation_calls(answers: dict) -> list:
    """(name, prompts) per call; a conversation's next turn is its last prompt + answer + a
    question (`answers[name]` holds what the engine answered for that conversation)."""

    def turn(name: str, question: list[int]) -> list[int]:
        prompt, answer = answers.get(name, (SYSTEM, []))
        return list(prompt) + list(answer) + question

    return [
        ("a", lambda: [turn("a", prompt_ids(2, 20))]),
        ("a", lambda: [turn("a", prompt_ids(3, 9))]),  # a's next turn
        ("b", lambda: [turn("b", prompt_ids(4, 30))]),  # another conversation, same system message
        ("a", lambda: [turn("a", prompt_ids(5, 12))]),  # back to a
        ("x", lambda: [SYSTEM[: 3 * B + 7]]),  # a strict prefix of stored prompts, ending inside a block
        ("x", lambda: [[299] + SYSTEM[1:]]),  # diverges at its first token
        ("x", lambda: [turn("a", []), prompt_ids(6, 40), SYSTEM + prompt_ids(7, 25)]),  # a batch of rows
    ]


def run_call(engine: Engine, prompts, max_new: int, spec=None):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    done = [e for e in engine.generate(prompts, params, spec=spec) if isinstance(e, DoneEvent)][0]
    return [list(o.token_ids) for o in done.outputs], done.stats


def run_sequence(engine: Engine, reference: Engine | None, spec=None, max_new: int = 10):
    """Run the calls; with `reference` (a fresh engine without the cache), compare each."""
    answers: dict = {}
    cached = []
    for name, prompts_of in conversation_calls(answers):
        prompts = prompts_of()
        got, stats = run_call(engine, prompts, max_new, spec)
        assert stats.draft_losses == 0, stats.draft_lost  # equal tokens from plain steps would prove nothing
        if reference is not None:
            want, _ = run_call(reference, prompts, max_new)
            assert got == want, f"call {name} differs with the prefix cache"
        if name != "x":
            answers[name] = (prompts[0], got[0])
        cached.append(stats["cached_prompt_tokens"])
    return cached
