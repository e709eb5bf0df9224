"""Turning OpenAI-style inputs into prompt token ids.

Chat messages go through the tokenizer's chat template (with
`--chat-template-args` and per-request `chat_template_kwargs`); tokenizers
without a template get mlx-lm's plain role-prefixed rendering.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.server import convert_chat


def chat_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_args: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered for generation (assistant turn opened,
    unless `add_generation_prompt` is False)."""
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        kwargs = dict(template_args or {})
        if tools:
            kwargs["tools"] = tools
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return token_ids(ids)
    return token_ids(tokenizer.encode(convert_chat(messages)))


def token_ids(ids: Any) -> list[int]:
    """`ids` as a list of Python ints, or TypeError (a template that rendered something else)."""
    if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"the chat template rendered {type(ids).__name__}, not token ids")
    return list(ids)


def completion_tokens(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of a completion prompt (text, or ids passed through)."""
    if isinstance(prompt, list):
        return list(prompt)
    return list(tokenizer.encode(prompt))
