"""Stored responses (`store: true` on `/v1/responses`) and the agent APIs' counters.

A stored response keeps what a later request's `previous_response_id`
continues from (the conversation it ended, as chat-template messages) and
the body `GET /v1/responses/{id}` returns. The store is capped in bytes
(`--response-store-bytes`, each entry measured as its JSON): the oldest
entries leave first, and one larger than the cap is not stored (its
response says `store: false`). Its size is in `/metrics`.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..settings import DEFAULT_RESPONSE_STORE_BYTES


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # the conversation, its answer included (no instructions)
    nbytes: int


class ResponseStore:
    """Insertion-ordered, capped in bytes; used from the event loop only."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Store; False when the entry alone is over the cap (nothing stored)."""
        nbytes = len(json.dumps(body)) + len(json.dumps(messages, default=str))
        if nbytes > self.max_bytes:
            return False
        self.delete(rid)
        while self._items and self.bytes + nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        self._items[rid] = StoredResponse(body, messages, nbytes)
        self.bytes += nbytes
        return True

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        old = self._items.pop(rid, None)
        if old is None:
            return False
        self.bytes -= old.nbytes
        return True


@dataclass
class AgentCounters:
    """What the agent APIs count for /metrics: the response store, and hosted
    tools (web_search, ...) left out of prompts, by type."""

    store_bytes: int = DEFAULT_RESPONSE_STORE_BYTES
    store: ResponseStore = field(init=False)
    hosted_tools: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.store = ResponseStore(self.store_bytes)
