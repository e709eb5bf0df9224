"""Turning OpenAI-style inputs into prompt token ids.

Chat messages go through the tokenizer's chat template (with
`--chat-template-args` and per-request `chat_template_kwargs`) after
mlx_lm.server's own preparation (`process_message_content`: the `arguments`
of assistant `tool_calls` sent as JSON strings are decoded to objects, which
templates that iterate them need); tokenizers without a template get
mlx-lm's plain role-prefixed rendering (`convert_chat`, with the request's
`role_mapping`).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.server import convert_chat, process_message_content


def has_chat_template(tokenizer: Any) -> bool:
    return bool(
        getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)
    )


def chat_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_args: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    role_mapping: dict[str, str] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered for generation (assistant turn opened,
    unless `add_generation_prompt` is False).

    `messages` are changed in place (tool-call arguments decoded); a JSON
    string that is not valid JSON raises `ValueError`.
    """
    if has_chat_template(tokenizer):
        process_message_content(messages)
        kwargs = dict(template_args or {})
        if tools:
            kwargs["tools"] = tools
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return token_ids(ids)
    return token_ids(tokenizer.encode(convert_chat(messages, role_mapping)))


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


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The variables the tokenizer's chat template reads from its context
    (empty without a template, or when it cannot be parsed)."""
    import jinja2
    from jinja2 import meta

    template = getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template]
    names: set[str] = set()
    for source in sources:
        if isinstance(source, str):
            try:
                env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
                names |= meta.find_undeclared_variables(env.parse(source))
            except jinja2.TemplateError:
                continue
    return frozenset(names)
