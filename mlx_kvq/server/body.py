"""Request bodies as JSON that everything downstream can take.

JSON allows more than the rest of the server can handle: nesting deep enough
to exhaust Python's recursion, integers too long to convert, and strings
holding lone UTF-16 surrogates (`"\\ud800"`) that can be neither encoded nor
rendered by a chat template. Each is refused here with a 400 naming the
field, so no request reaches the engine carrying one.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # JSON nesting accepted; OpenAI request bodies need fewer than ten


class BodyError(ValueError):
    """The body cannot be accepted; `param` is the top-level field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or `BodyError`."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BodyError(f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise BodyError(f"the request body holds a value that cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    check_values(data)
    return data


def check_values(data: dict[str, Any]) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings that are not valid Unicode."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise BodyError(
                f"{_dotted(path[:3])}...: the request body is nested more than "
                f"{MAX_DEPTH} levels deep",
                _safe(path[0]),
            )
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*path, key))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(
            f"{_dotted(path)}: the string holds a lone UTF-16 surrogate, which is not "
            "valid Unicode; send the character itself or a valid surrogate pair",
            _safe(path[0]) if path else None,
        ) from None


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(_safe(p) for p in path) if path else "body"


def _safe(name: str) -> str:
    """A field name that can be written into an error body (surrogates escaped)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")
