"""From request bytes to prompt token ids, off the event loop and bounded.

Parsing a large body, rendering a chat template and tokenizing take time in
proportion to the request (100,000 messages: seconds). Done in a handler,
they stall the event loop: `/live` stops answering and every running stream
stops sending. `PromptWork` runs them on its own threads, at most `workers`
requests at once (the others wait their turn without holding a thread), and
refuses what cannot fit the context before any work proportional to it:

- a lower bound of the prompt's tokens is read from the parsed JSON before
  it is validated or rendered: the characters of the text every template
  renders (the content of non-assistant messages, a completion's prompt),
  divided by the most characters one token can cover (the longest
  vocabulary entry, times 4 for a normalizer composing up to 4 code points
  into one, Unicode's longest canonical decomposition); token-id prompts
  count exactly. A request at or over the context by that bound is refused
  with 400 `context_length_exceeded`; nothing that could fit is.
- the body's size is already capped (`--max-request-bytes`) as it arrives.

Every endpoint that turns a request into a prompt goes through here: its
body is parsed on these threads, checked with `check_fits` as it is
(`request_body.read_routed`), then `chat` or `completion` (or `run` for
other work).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from mlx_kvq.engine.prompts import chat_tokens, completion_tokens
from mlx_kvq.engine.segments import Checkpoint, chat_checkpoints

T = TypeVar("T")
COMPOSITION = 4  # code points a Unicode normalizer may compose into one (canonical, at most)
RENDERED_ROLES = ("system", "developer", "user", "tool", "function")  # templates render these


class PromptTooLong(Exception):
    """The prompt cannot fit the context."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its token ids and the segment checkpoints the prompt
    cache keeps; `tool_grammar` is the grammar its answer follows when its
    tools are given in the generic format (`json_tools.py`)."""

    tokens: list[int]
    checkpoints: tuple[Checkpoint, ...]
    tool_grammar: str | None = None


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (added tokens included): no token
    covers more characters of normalized text (byte-level entries spell one
    character per byte, so they overcount)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1)


def text_chars(data: dict[str, Any]) -> tuple[int, int]:
    """(characters of rendered text, token ids) a raw request body holds, read
    without validating it: whatever has an unexpected shape counts 0."""
    chars = ids = 0
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids += len(prompt)
    for key in ("system", "instructions", "input"):  # other APIs' top-level text
        if isinstance(data.get(key), str):
            chars += len(data[key])
    messages = data.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in RENDERED_ROLES:
                chars += _content_chars(m.get("content"))
    return chars, ids


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


class PromptWork:
    """Prompt preparation for one tokenizer and context (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_context: int | None, workers: int):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.chars_per_token = longest_token_chars(tokenizer) * COMPOSITION
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="mlx-kvq-prompt")
        self._slots = asyncio.Semaphore(workers)

    def sibling(self, tokenizer: Any, max_context: int | None) -> PromptWork:
        """Prompt preparation for another model's tokenizer and context, on
        these threads and within this cap (one app serving several models)."""
        other = object.__new__(PromptWork)
        other.tokenizer = tokenizer
        other.max_context = max_context
        other.chars_per_token = longest_token_chars(tokenizer) * COMPOSITION
        other._executor, other._slots = self._executor, self._slots
        return other

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a prompt thread, once one of the `workers` slots is free."""
        async with self._slots:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def min_tokens(self, data: dict[str, Any]) -> int:
        """A lower bound of the tokens of the prompt the raw body `data` asks for."""
        chars, ids = text_chars(data)
        return ids + math.ceil(chars / self.chars_per_token)

    def check_fits(self, data: dict[str, Any]) -> None:
        """Refuse (`PromptTooLong`) a body whose prompt cannot fit the context."""
        if self.max_context is None:
            return
        least = self.min_tokens(data)
        if least >= self.max_context:
            raise PromptTooLong(
                f"the prompt has at least {least} tokens; this server's KV plan allows a "
                f"context of {self.max_context} tokens"
            )

    async def chat(
        self,
        messages: list[dict[str, Any]],
        template_args: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        role_mapping: dict[str, str] | None = None,
    ) -> ChatPrompt:
        """`messages` rendered with the chat template and tokenized, with checkpoints."""

        def work() -> ChatPrompt:
            tokens = chat_tokens(self.tokenizer, messages, template_args, tools, role_mapping)
            checkpoints = ()
            if self.max_context is None or len(tokens) < self.max_context:
                checkpoints = chat_checkpoints(
                    self.tokenizer, messages, tokens, template_args, tools
                )
            return ChatPrompt(tokens, checkpoints)

        return await self.run(work)

    async def completion(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion prompt's token ids (text tokenized, ids passed through)."""
        return await self.run(completion_tokens, self.tokenizer, prompt)
