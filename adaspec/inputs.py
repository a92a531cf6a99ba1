"""Prompts as vLLM's offline API takes them: a string, a list of token ids, or the dicts
`TextPrompt` ({"prompt": str}) and `TokensPrompt` ({"prompt_token_ids": list[int]}), vLLM's
documented way to pass token ids since its `prompt_token_ids=` keyword went away."""
from __future__ import annotations

import numbers
from typing import TypedDict

from adaspec.errors import InvalidRequestError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


def prompt_of(p) -> str | list[int]:
    """One prompt in any of those forms -> a string or a list of token ids (what the engine takes);
    a dict with any other key is refused by name (multi-modal data and the like are not served)."""
    if not isinstance(p, dict):
        return p
    keys = set(p)
    if keys == {"prompt"}:
        return p["prompt"]
    if keys == {"prompt_token_ids"}:
        return p["prompt_token_ids"]
    other = sorted(keys - {"prompt", "prompt_token_ids"})
    if other:
        raise InvalidRequestError(f"prompt dict key(s) {other} are not supported by adaspec: give {{\"prompt\": str}} "
                                  "or {\"prompt_token_ids\": [int, ...]}", param="prompt")
    raise InvalidRequestError("a prompt dict holds \"prompt\" or \"prompt_token_ids\", not both (nor neither)",
                              param="prompt")


def is_single_prompt(prompts) -> bool:
    """A string, a dict, or a list of token ids is one prompt; anything else a sequence of them."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], numbers.Integral))  # numpy's too
