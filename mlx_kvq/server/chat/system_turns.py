"""System turns after the first one, for chat templates that cannot render them.

Claude Code and Codex send system messages in the middle of a conversation;
many chat templates refuse or drop them. Whether the served template renders
them is decided once, when the app is built (`renders_mid_system`); where it
does not, they are folded into the user turn next to them (`fold_system`).
"""

from __future__ import annotations

from typing import Any

MID_SYSTEM_PROBE = "mid-conversation-system-probe"


def renders_mid_system(tokenizer: Any) -> bool:
    """Whether the chat template renders a system message after the first turn
    (Claude Code and Codex send them); decided once, when the app is built."""
    messages = [{"role": "user", "content": "a"},
                {"role": "system", "content": MID_SYSTEM_PROBE},
                {"role": "user", "content": "b"}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses them
        return False
    return isinstance(text, str) and MID_SYSTEM_PROBE in text


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first turn as user text, joined to the user turn
    next to them (for templates that refuse or drop them; see `renders_mid_system`)."""

    def plain_user(m: dict[str, Any] | None) -> bool:
        return m is not None and m["role"] == "user" and set(m) == {"role", "content"}

    out: list[dict[str, Any]] = []
    held: list[str] = []  # folded system text waiting for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            held.append(m.get("content") or "")
            continue
        if held and plain_user(m):
            m = {"role": "user", "content": "\n\n".join([*held, m["content"] or ""])}
            held = []
        elif held:
            out.append(user_turn(out, held))
            held = []
        out.append(m)
    if held:
        out.append(user_turn(out, held))
    return out


def user_turn(out: list[dict[str, Any]], held: list[str]) -> dict[str, Any]:
    """Folded system text as a user turn: joined to the user turn before it when
    there is one (it is taken off `out`), else a turn of its own."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "user" and set(last) == {"role", "content"}:
        out.pop()
        return {"role": "user", "content": "\n\n".join([last["content"] or "", *held])}
    return {"role": "user", "content": "\n\n".join(held)}
