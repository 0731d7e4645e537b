"""Prompt text -> token ids: raw prompts and chat conversations (the model's template).

One definition for the Engine and the server, so a conversation sent to the server and
`generate --chat` with the same user message encode to the same ids. Knows nothing of
generation; `tokenizer` is the target's Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ssdlocal.core.errors import UsageError


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of one prompt, through the chat template (one user turn) when `chat`."""
    if not prompt.strip():
        raise UsageError("empty prompt", "pass some text to generate from")
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(prompt))


def encode_messages(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of a conversation ({"role", "content"} dicts, assistant `tool_calls` and
    `tool` results as chat templates take them) with the assistant's turn opened; `tools`
    (OpenAI function dicts) are rendered by the template itself."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this model's tokenizer has no chat template", "drop --chat to use a raw prompt")
    extra = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
    return list(tokenizer.encode(text, add_special_tokens=False))
