"""Template variables a request (or `--chat-template-args`) may set, checked.

A template variable only fills a name the model's chat template reads; it may
not replace the template, a rendering argument or a sandbox global.
"""

from __future__ import annotations

from typing import Any

# chat_template_kwargs keys that would change what rendering returns (a
# tensor, a dict, text instead of token ids) or the roles of the arguments the
# server passes itself: refused with a 400 instead of reaching the template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt", "continue_final_message", "conversation", "documents",
        "max_length", "messages", "padding", "return_assistant_tokens_mask", "return_dict",
        "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    }
)  # fmt: skip
# The names a chat template's sandbox provides (Jinja's globals and those
# transformers adds): a variable of the same name would replace them.
TEMPLATE_GLOBALS = frozenset(
    {"cycler", "dict", "joiner", "lipsum", "namespace", "range", "raise_exception", "strftime_now"}
)
TEMPLATE_OVERRIDE = "chat_template"  # a template of the client's own: never accepted


def check_template_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the first key of `kwargs` that is not a plain
    template variable, or a value that is not plain JSON.

    A template variable only fills a name the model's template reads: it may
    not replace the template (`chat_template`: rendering a client's Jinja has
    no bound on time or memory), a rendering argument, a sandbox global, or a
    name that is not an identifier; its value is a string, number, boolean,
    null, or a list or object of those."""
    if TEMPLATE_OVERRIDE in kwargs:
        raise ValueError(
            f"{where} may not set 'chat_template': requests are rendered with the model's "
            "own chat template (a server can be started with --chat-template)"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"{where} may not set {reserved[0]!r}: the server renders the prompt to "
            "token ids itself (reserved: " + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)) + ")"
        )
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ValueError(
                f"{where} may not set {key!r}: a template variable is an identifier "
                "that does not start with '_'"
            )
        if key in TEMPLATE_GLOBALS:
            raise ValueError(
                f"{where} may not set {key!r}: it would replace the template sandbox's own {key!r}"
            )
        if not plain_json(value):
            raise ValueError(
                f"{where}: {key!r} must be a plain JSON value (string, number, boolean, "
                f"null, or a list or object of those), not {type(value).__name__}"
            )


def plain_json(value: Any) -> bool:
    """Whether `value` is made of JSON's types only (no objects with attributes to reach)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or type(v) in (str, int, float, bool):
            continue
        if type(v) is list:
            stack.extend(v)
        elif type(v) is dict and all(type(k) is str for k in v):
            stack.extend(v.values())
        else:
            return False
    return True
