"""Hypothesis strategies for JSON bodies from a JSON schema (the subset pydantic
writes into `/openapi.json`): `$ref`, `anyOf`, `type`, `enum`, `const`,
numeric and length bounds, `items`, `properties`, `required` and
`additionalProperties`. Bodies that the schema allows reach the server's
deepest paths (tools, grammars, penalties, logit_bias); `mutated` adds the
ones it does not (a required field missing, an unknown field, a wrong
value). (hypothesis-jsonschema 0.23 no longer runs on current hypothesis.)
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

TEXT = st.text(max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


def from_schema(schema: dict[str, Any], root: dict[str, Any] | None = None) -> st.SearchStrategy:
    """Values `schema` allows; `$ref`s resolve against `root` (default: `schema`)."""
    root = schema if root is None else root
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return st.deferred(lambda: from_schema(target, root))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return JSON
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(
            min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 20), 20)
        )
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**64) - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**64 + 1) - 1)
        return st.integers(low, high)
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}), root)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=min(schema.get("maxItems", low + 3), low + 3))
    if kind == "object":
        return _object(schema, root)
    raise ValueError(f"unsupported schema: {schema}")


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy:
    props = schema.get("properties", {})
    required = [k for k in schema.get("required", []) if k in props]
    optional = [k for k in props if k not in required]
    extra = schema.get("additionalProperties", True)

    @st.composite
    def build(draw):
        out = {k: draw(from_schema(props[k], root)) for k in required}
        for k in (
            draw(st.lists(st.sampled_from(optional), max_size=6, unique=True)) if optional else []
        ):
            out[k] = draw(from_schema(props[k], root))
        if extra is not False and draw(st.booleans()):
            values = JSON if extra is True else from_schema(extra, root)
            out.update(
                draw(st.dictionaries(TEXT.filter(lambda k: k not in props), values, max_size=2))
            )
        return out

    return build()


def mutated(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """Bodies with one thing wrong: a field dropped, added, or given a random value."""

    @st.composite
    def mutate(draw):
        body = dict(draw(bodies))
        how = draw(st.sampled_from(["drop", "add", "replace"]))
        if how == "add" or not body:
            body[draw(TEXT)] = draw(JSON)
        elif how == "drop":
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.sampled_from(sorted(body)))] = draw(JSON)
        return body

    return mutate()
