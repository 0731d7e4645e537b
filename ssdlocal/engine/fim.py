"""Fill-in-the-middle prompts in the model's own tokens: the text before the cursor, the
text after it, and (repository level) other files as context.

`fim_tokens(tokenizer)` finds the FIM tokens a tokenizer has, by their names in its
vocabulary (never by the model's name): Qwen2.5-Coder / CodeGemma `<|fim_prefix|>`,
`<|fim_suffix|>`, `<|fim_middle|>` (with `<|repo_name|>` / `<|file_sep|>`), StarCoder
`<fim_prefix>`... (with `<repo_name>` / `<file_sep>`), CodeLlama `▁<PRE>` / `▁<SUF>` /
`▁<MID>`, DeepSeek-Coder `<｜fim▁begin｜>` / `<｜fim▁hole｜>` / `<｜fim▁end｜>`; None when it has
none. `fim_prompt` lays a request out the way llama.cpp's server does (PSM order):

    [REPO]myproject\n [SEP]name\n text ... [SEP]filename\n [PRE]before prompt [SUF]after [MID]

The special tokens are inserted as ids, and the user's text is encoded without special
tokens' parsing, so text that spells `<|fim_suffix|>` cannot move the cursor. Knows
nothing of HTTP or of generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ssdlocal.core.errors import UsageError

REPO_NAME = "myproject"  # what llama.cpp's server names the repository (editors send none)
CURRENT_FILE = "filename"  # ... and the file being edited
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # between context files when there is no file token


@dataclass(frozen=True)
class _Style:
    name: str
    prefix: tuple[str, ...]  # accepted spellings of each token, in order of preference
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()


_STYLES = (
    _Style(
        "qwen", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",), ("<|repo_name|>",), ("<|file_sep|>",)
    ),
    _Style(
        "starcoder",
        ("<fim_prefix>",),
        ("<fim_suffix>",),
        ("<fim_middle>",),
        ("<repo_name>", "<reponame>"),
        ("<file_sep>",),
    ),
    _Style("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>")),
    _Style("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",)),
)


@dataclass(frozen=True)
class FimTokens:
    """The ids of one tokenizer's FIM tokens; `repo` / `file_sep` None where it has none."""

    style: str  # "qwen" | "starcoder" | "codellama" | "deepseek"
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


@dataclass(frozen=True)
class ContextFile:
    """Another file given as context (llama.cpp's `input_extra` chunk)."""

    filename: str
    text: str


def _token_id(tokenizer, names: tuple[str, ...]) -> int | None:
    """The id of the first of `names` that is one token of the vocabulary, or None."""
    unk = getattr(tokenizer, "unk_token_id", None)
    for name in names:
        try:
            tid = tokenizer.convert_tokens_to_ids(name)
        except (KeyError, ValueError, TypeError):
            continue
        if isinstance(tid, int) and tid >= 0 and tid != unk and tokenizer.convert_ids_to_tokens(tid) == name:
            return tid
    return None


def _style_tokens(tokenizer, style: _Style) -> FimTokens | None:
    """`style`'s FIM tokens in the tokenizer, or None unless it has all three of prefix, suffix, middle."""
    prefix, suffix, middle = (_token_id(tokenizer, names) for names in (style.prefix, style.suffix, style.middle))
    if prefix is None or suffix is None or middle is None:
        return None
    repo = _token_id(tokenizer, style.repo) if style.repo else None
    file_sep = _token_id(tokenizer, style.file_sep) if style.file_sep else None
    return FimTokens(style.name, prefix, suffix, middle, repo=repo, file_sep=file_sep)


def fim_tokens(tokenizer) -> FimTokens | None:
    """The tokenizer's FIM tokens (the first style whose three tokens it has all), or None."""
    for style in _STYLES:
        found = _style_tokens(tokenizer, style)
        if found is not None:
            return found
    return None


def no_fim_error(param: str = "suffix") -> UsageError:
    """The error for a FIM request to a model without FIM tokens (`param` names the field)."""
    return UsageError(
        f"this model has no fill-in-the-middle tokens, so '{param}' cannot be used",
        "serve a code model trained for fill-in-the-middle (e.g. Qwen2.5-Coder, StarCoder, CodeLlama), "
        f"or send the text before the cursor alone without '{param}'",
    )


def _encode(tokenizer, text: str) -> list[int]:
    """Ids of user text, special tokens' spellings read as plain text."""
    if not text:
        return []
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer.encode(text, add_special_tokens=False))


def _bos(tokenizer) -> list[int]:
    """[bos] when the tokenizer starts its encodings with one (llama, CodeLlama), else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    probe = list(tokenizer.encode("a"))
    return [bos] if probe[:1] == [bos] else []


def fim_prompt(
    tokenizer,
    tokens: FimTokens,
    before: str,
    after: str,
    *,
    prompt: str = "",
    extra: Sequence[ContextFile] = (),
    repo_level: bool | None = None,
) -> list[int]:
    """Token ids of a FIM request: `before` and `after` the cursor, `prompt` (text typed at
    the cursor, read as the end of `before`), and `extra` context files placed first - with
    the repository and file tokens when the tokenizer has them, else separated by a plain
    marker. `repo_level` (None: when there are context files) names the repository and the
    current file where the tokenizer has those tokens, as llama.cpp's /infill always does.
    The model's answer is the middle."""
    repo_level = bool(extra) if repo_level is None else repo_level
    head: list[int] = []
    if repo_level and tokens.repo is not None:
        head += [tokens.repo, *_encode(tokenizer, REPO_NAME + "\n")]
    for chunk in extra:
        if tokens.file_sep is not None:
            head += [tokens.file_sep, *_encode(tokenizer, (chunk.filename or "tmp") + "\n")]
        else:
            head += _encode(tokenizer, CHUNK_SEPARATOR)
        head += _encode(tokenizer, chunk.text)
    if repo_level and tokens.file_sep is not None:
        head += [tokens.file_sep, *_encode(tokenizer, CURRENT_FILE + "\n")]
    return [
        *_bos(tokenizer),
        *head,
        tokens.prefix,
        *_encode(tokenizer, before + prompt),
        tokens.suffix,
        *_encode(tokenizer, after),
        tokens.middle,
    ]
