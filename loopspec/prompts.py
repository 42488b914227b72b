"""Prompts: `{"turns": [...]}` JSONL files, one conversation per line (bench, tune, data, calibration),
and turning a prompt into token ids the way every entry point does (the chat template included)."""

from __future__ import annotations

import json
from pathlib import Path

from loopspec.errors import LoopspecError


def read_conversations(
    path: str | Path, limit: int | None = None, what: str = "prompt file"
) -> list[tuple[int, list[str]]]:
    """(1-based line number in the file, turns) of each non-blank line, up to `limit` lines."""
    path = Path(path)
    if not path.is_file():
        raise LoopspecError(f"{what} does not exist: {path}")
    conversations: list[tuple[int, list[str]]] = []
    # split on "\n" only: str.splitlines() would also split at U+2028 inside JSON strings
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise LoopspecError(
            f"{path}:{line}: {what} is not UTF-8 text (byte {e.start}: "
            f"{data[e.start : e.start + 1]!r}); save it as UTF-8"
        ) from None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LoopspecError(f"{path}:{number}: expected a JSON object with a 'turns' list") from None
        except RecursionError:  # the decoder recurses once per nesting level
            raise LoopspecError(
                f"{path}:{number}: JSON nested too deeply (expected a JSON object with a 'turns' list)"
            ) from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise LoopspecError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
        conversations.append((number, turns))
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        raise LoopspecError(f"no prompts in {path}")
    return conversations


def read_prompts(
    path: str | Path, limit: int | None = None, all_turns: bool = False, what: str = "prompt file"
) -> list[str]:
    """The first turn of each line (every turn with `all_turns`), up to `limit` prompts."""
    prompts: list[str] = []
    # with all_turns a line holds several prompts: read every line, then cut at `limit` prompts
    for _, turns in read_conversations(path, None if all_turns else limit, what):
        prompts.extend(turns if all_turns else turns[:1])
    return prompts[:limit] if limit is not None else prompts


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Chat messages ({role, content}) → the prompt of the tokenizer's chat template with the
    assistant's turn opened; `tools` (OpenAI's function list) go to the template as its `tools`."""
    if not getattr(tokenizer, "chat_template", None):
        raise LoopspecError("this model has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 — templates raise on role orders they do not accept
        raise LoopspecError(f"the messages do not fit the chat template: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, text: str, chat: bool = True) -> list[int]:
    """One user prompt → token ids: a user turn of the chat template when `chat` and the tokenizer
    has one, else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


PLACEHOLDER = "\x00loopspec-user-turn\x00"


def user_turn_prefix_ids(tokenizer) -> list[int]:
    """The chat template's tokens before a user message's text (its system prompt and the user's
    header): a model continued from them writes a user prompt, as its chat training taught it."""
    if not getattr(tokenizer, "chat_template", None):
        raise LoopspecError("this model has no chat template, so it cannot write user prompts")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=False, tokenize=False
    )
    if PLACEHOLDER not in text:
        raise LoopspecError("the chat template does not show a user message's text, so it cannot write user prompts")
    return tokenizer.encode(text[: text.index(PLACEHOLDER)], add_special_tokens=False)
