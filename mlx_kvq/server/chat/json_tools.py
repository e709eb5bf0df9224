"""The generic tool format (`--tool-format json`), for models whose chat
template renders no tools (Gemma 3's template, most base models).

llama-server's generic chat format is the anchor: the tools reach the model
as text the server writes, and the answer is held to a grammar. Here:

- the tools are described in a system block (`system_block`) put before the
  conversation's own system prompt: one JSON line per tool, and how to call
  one;
- the answer is constrained by an llguidance grammar (`grammar`) to plain
  text, or to one JSON object and nothing after it,
  `{"tool_call": {"name": ..., "arguments": {...}}}`, whose `name` is one
  of the tools and whose `arguments` match that tool's parameters; with a
  required call (`tool_choice` required, Anthropic's `any`, or a named
  tool) only the call is allowed;
- the answer is read back by `JsonToolOutput`: text streams as it comes,
  an answer that opens with `{` is held and parsed into one call at its end
  (a call cut off by `max_tokens` comes back as text);
- the history is rewritten for a template that knows only system, user and
  assistant turns (`conversation`): an assistant's calls as the JSON it
  would have written, a tool's result as a user turn
  `{"tool_response": {"name": ..., "content": ...}}`, consecutive user
  turns joined.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from .output import ChatDelta
from .tools import new_call_id

CALL = "tool_call"
RESULT = "tool_response"
TEXT_RULE = r"/\s*([^{\s][\s\S]*)?/"  # any text whose first non-blank character is not '{'


def functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function specs of `tools` (OpenAI's `{"type": "function", "function": ...}`)."""
    return [t["function"] for t in tools]


def system_block(tools: list[dict[str, Any]], required: bool = False) -> str:
    """The text that tells the model its tools and how to call one."""
    lines = [
        json.dumps(
            {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None},
            ensure_ascii=False,
        )
        for fn in functions(tools)
    ]
    how = "Answer with a tool call only" if required else "To call a tool, answer with only"
    return (
        "You can call these tools (one JSON object each):\n" + "\n".join(lines) + "\n\n"
        f'{how}: {{"{CALL}": {{"name": <tool name>, "arguments": <arguments object>}}}} '
        "and nothing else"
        + ("." if required else "; otherwise answer in plain text.")
        + f' A tool\'s result comes back in the next user turn as {{"{RESULT}": ...}}.'
    )


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it in this format."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            pass
    return json.dumps({CALL: {"name": name, "arguments": arguments}}, ensure_ascii=False)


def conversation(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], required: bool = False
) -> list[dict[str, Any]]:
    """`messages` with the tools' system block first, calls and results as text
    (see the module docstring)."""
    block = system_block(tools, required)
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> tool name, for the results
    for i, m in enumerate(messages):
        m = dict(m)
        if i == 0 and m["role"] == "system":
            m["content"] = "\n\n".join([block, m.get("content") or ""]).rstrip()
            block = ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            texts = [m.get("content") or ""]
            for c in m.pop("tool_calls"):
                fn = c.get("function", {})
                names[c.get("id", "")] = fn.get("name", "")
                texts.append(call_text(fn.get("name", ""), fn.get("arguments", {})))
            m["content"] = "\n".join(t for t in texts if t)
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id", "")
            result = {"name": names.get(call_id, call_id), "content": m.get("content") or ""}
            m = {"role": "user", "content": json.dumps({RESULT: result}, ensure_ascii=False)}
        last = out[-1] if out else None
        if last is not None and last["role"] == m["role"] == "user" and len(m) == len(last) == 2:
            last["content"] = f"{last['content']}\n\n{m['content']}"
            continue
        out.append(m)
    if block:
        out.insert(0, {"role": "system", "content": block})
    return out


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else")


def closed(schema: Any, close: bool = True) -> Any:
    """`schema` with every object that lists its `properties` and says nothing
    of `additionalProperties` closed to other keys (a copy): JSON Schema lets
    such an object take any other key, and a model held to it wanders into
    keys the tool never declared (Gemma 3 270M wrote `"type": "object"` into
    the arguments of a weather tool); a call's arguments are the declared
    ones, as OpenAI's and Anthropic's strict tool modes make them. The
    branches of an `allOf`, and an object with one, stay open at their own
    level: their keys add up, and closing each would refuse the others'."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(s, close=False) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(s) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    open_keys = ("additionalProperties", "unevaluatedProperties", "allOf")
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call to one of `tools` (or to the tool `name`),
    its arguments held to the declared parameters (`closed`)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": closed(fn.get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in functions(tools)
        if name is None or fn["name"] == name
    ]
    if not options:
        raise ValueError(f"no tool named {name!r} among the request's tools")
    return {
        "type": "object",
        "properties": {CALL: options[0] if len(options) == 1 else {"anyOf": options}},
        "required": [CALL],
        "additionalProperties": False,
    }


def grammar(tools: list[dict[str, Any]], required: bool = False, name: str | None = None) -> str:
    """The llguidance grammar of an answer: plain text or one call (only the
    call when `required` or `name` is given)."""
    call = "call: /\\s*/ %json " + json.dumps(call_schema(tools, name))
    if required or name is not None:
        return llguidance.LLMatcher.grammar_from_lark(f"start: call\n{call}\n")
    return llguidance.LLMatcher.grammar_from_lark(
        f"start: text | call\ntext: {TEXT_RULE}\n{call}\n"
    )


class JsonToolOutput:
    """One answer in this format, split into content and a tool call (the
    interface of `output.ChatOutput`)."""

    def __init__(self, streaming: bool):
        self.streaming = streaming
        self.held = ""  # text not given out yet: leading blanks, or the whole call
        self.calling: bool | None = None  # decided by the first non-blank character

    def feed(self, text: str) -> ChatDelta:
        if self.calling is False:
            return ChatDelta(content=text)
        self.held += text
        if self.calling is None and self.held.strip():
            self.calling = self.held.lstrip().startswith("{")
            if not self.calling:
                text, self.held = self.held, ""
                return ChatDelta(content=text)
        return ChatDelta()

    def finish(self, reason: str) -> tuple[ChatDelta, str]:
        """The rest of the answer and OpenAI's finish reason (`tool_calls` after a call)."""
        held, self.held = self.held, ""
        if not self.calling:
            return ChatDelta(content=held), reason
        try:
            call = json.loads(held)[CALL]
            name, arguments = call["name"], call["arguments"]
            if not isinstance(name, str):
                raise TypeError("the name is not a string")
        except (ValueError, KeyError, TypeError):  # cut off by max_tokens: the text stays
            return ChatDelta(content=held), reason
        out: dict[str, Any] = {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        if self.streaming:
            out["index"] = 0
        return ChatDelta(tool_calls=[out]), "tool_calls" if reason == "stop" else reason
