"""Frozen dataclasses as JSON for the other ranks, derived from their fields.

Every field of a message crosses unless the caller declares it local (with
the reason), so a field added to a request cannot be dropped on the way to
the other ranks in silence: `encode` walks `dataclasses.fields` (nested
dataclasses, enums, tuples, frozensets and JSON scalars), `decode` rebuilds
the values from the type hints. A value of any other kind (a callable, an
array) raises TypeError naming the field: declare it local or make it data.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

# (dataclass, field name) -> why the field stays on the rank that built it
LocalFields = dict[tuple[type, str], str]

_SCALARS = (bool, int, float, str)


def encode(value: Any, local: LocalFields | None = None, where: str = "") -> Any:
    """`value` as JSON-ready data; fields declared in `local` are left out."""
    local = local or {}
    if is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {
            f.name: encode(getattr(value, f.name), local, f"{cls.__name__}.{f.name}")
            for f in fields(value)
            if (cls, f.name) not in local
        }
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [encode(v, local, where) for v in value]
    if isinstance(value, frozenset | set):
        return [encode(v, local, where) for v in sorted(value)]
    if value is None or isinstance(value, _SCALARS):
        return value
    raise TypeError(
        f"{where or type(value).__name__}: a {type(value).__name__} cannot cross to the "
        "other ranks; declare the field local (with the reason) or send it as data"
    )


def decode(cls: type, data: dict[str, Any], local: LocalFields | None = None) -> Any:
    """The `cls` instance `encode` made `data` from (local fields take their defaults)."""
    local = local or {}
    hints = typing.get_type_hints(cls)
    return cls(**{
        f.name: _value(hints[f.name], data[f.name], local)
        for f in fields(cls)
        if (cls, f.name) not in local
    })  # fmt: skip


def _value(hint: Any, data: Any, local: LocalFields) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if data is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]  # Optional[X] only
        return _value(hint, data, local)
    if isinstance(hint, type) and is_dataclass(hint):
        return decode(hint, data, local)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(data)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, local) for v in data)
        return tuple(_value(a, v, local) for a, v in zip(args, data, strict=True))
    if origin is frozenset:
        return frozenset(_value(args[0], v, local) for v in data)
    if hint is float:
        return float(data)
    return data
