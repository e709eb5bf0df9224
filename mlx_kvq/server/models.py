"""Requests to the model they name: the pool's models (`mlx_kvq.residency`),
each resident one answered by a `ChatService` of its own.

Which model a `model` name reaches: OpenAI's endpoints (and every API once
`--served-model-name` is given) answer the names the pool knows or can load
(a declared name or alias, `default_model`, where a model loads from, or a
model directory, GGUF file or repo a request names, loaded on demand as
mlx_lm.server does, unless `--declared-models-only`) and 404 any other;
Anthropic's and the Responses API are sent their clients' own model names,
so there a name no model goes by reaches the default model (and a repo id
is not fetched).

A request for a model that is not resident waits for its load (one load,
however many requests wait; it goes on when a client leaves), then holds a
lease on the model until its answer ends. A model that cannot serve it is
an `APIError` naming the model and why (`residency.Refusal`: 404, 400, or
503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mlx_kvq.engine import EngineMetrics, Outcome
from mlx_kvq.residency import (
    Lease,
    Loaded,
    ModelPool,
    ModelState,
    ModelUnavailable,
    ModelView,
    Refusal,
)

from .chat.prompting import PromptWork
from .chat.service import ChatService
from .errors import APIError
from .settings import ServerSettings, ToolFormat

log = logging.getLogger("mlx_kvq.server")

ATTEMPTS = 3  # claims one request makes: its model may be evicted between its load and a claim


@dataclass(frozen=True)
class Routed:
    """A request's model: the service that answers it and the lease that keeps it resident."""

    service: ChatService
    lease: Lease


class ModelDirectory:
    """The app's models: names to services, resident models' services made
    once (and dropped with the model), refusals as API errors.

    `settings` are the server's (the default model's at startup: the API
    key, the body limits, whether names are checked); `prompts` the app's
    prompt threads, which every model's prompt work shares.
    """

    def __init__(self, pool: ModelPool, settings: ServerSettings, prompts: PromptWork):
        self.pool = pool
        self.settings = settings
        self.prompts = prompts
        self._services: weakref.WeakKeyDictionary[Loaded, ChatService] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._fallback = EngineMetrics()  # counts refusals while the default model is out

    # ------------------------------------------------------------ models
    @property
    def several(self) -> bool:
        """Whether the server knows more than one model (then reports label each)."""
        return len(self.pool.names()) > 1

    def views(self) -> list[ModelView]:
        return self.pool.views()

    def service(self, loaded: Loaded) -> ChatService:
        """The service of a resident model (made on first use)."""
        with self._lock:
            service = self._services.get(loaded)
            if service is None:
                settings, tokenizer = loaded.served, loaded.engine.tokenizer
                prompts = self.prompts
                if (
                    tokenizer is not prompts.tokenizer
                    or settings.max_context != prompts.max_context
                ):
                    prompts = prompts.sibling(tokenizer, settings.max_context)
                service = ChatService(loaded.engine, settings, prompts)
                self._services[loaded] = service
                describe(service)
        return service

    def resident(self, name: str) -> Loaded | None:
        """What model `name` has in memory now (None: not resident)."""
        try:
            view = self.pool.view(name)
        except KeyError:  # forgotten since it was looked up (its load failed)
            return None
        return view.loaded if view.state is ModelState.READY else None

    @property
    def metrics(self) -> EngineMetrics:
        """Where requests refused before they reach a model are counted: the
        default model's engine while it is resident."""
        loaded = self.resident(self.pool.default)
        return self._fallback if loaded is None else loaded.engine.metrics

    def count_request(self, outcome: Outcome) -> None:
        self.metrics.count_request(outcome)

    def reject(self, status: int, message: str, **kw) -> APIError:
        """An error refusing a request before its model is known, counted."""
        self.count_request(Outcome.REJECTED)
        return APIError(status, message, **kw)

    # ------------------------------------------------------------ routing
    def lookup(self, name: object, strict: bool) -> str | None:
        """The model `name` reaches (see the module docstring); None: a 404."""
        checked = strict or self.settings.names_checked
        if not isinstance(name, str):
            return self.pool.default
        key = self.pool.lookup(name, hub=checked)
        if key is None and not checked:
            return self.pool.default
        return key

    def ready(self, name: str) -> ChatService | None:
        """The service of model `name` when it is resident now (no lease taken)."""
        loaded = self.resident(name)
        return None if loaded is None else self.service(loaded)

    def not_found(self, name: str, counted: bool = True) -> APIError:
        """The 404 of a name no model goes by (`counted`: a refused request)."""
        served = ", ".join(f"'{n}'" for n in self.pool.names())
        message = f"the model '{name}' does not exist; this server serves {served}"
        make = self.reject if counted else APIError
        return make(404, message, param="model", code="model_not_found")

    def refusal(self, e: ModelUnavailable) -> APIError:
        return self.reject(
            e.status, e.message, param="model", code=e.refusal.value, retry_after=e.retry_after
        )

    async def acquire(self, name: str, gone: Callable[[], Awaitable[None]]) -> Routed:
        """Model `name`'s service and a lease on it, once it is resident: a
        load waited for (started if none runs), or the refusal naming it. A
        client that leaves meanwhile ends the wait (499), not the load."""
        for _ in range(ATTEMPTS):
            try:
                ticket = self.pool.claim(name)
            except ModelUnavailable as e:
                raise self.refusal(e) from None
            if isinstance(ticket, Lease):
                try:
                    return Routed(self.service(ticket.loaded), ticket)
                except BaseException:
                    ticket.release()
                    raise
            await self._loaded(name, ticket, gone)
        raise self.refusal(
            ModelUnavailable(
                name,
                Refusal.BUSY,
                f"model '{name}' was unloaded again before this request "
                "could use it: the memory budget is contended; retry",
                self.pool.retry_after,
            )  # fmt: skip
        )

    async def _loaded(self, name: str, load: Future, gone: Callable[[], Awaitable[None]]) -> None:
        waiting = asyncio.wrap_future(load)
        watcher = asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({waiting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if waiting not in done:
            waiting.add_done_callback(_retrieve)  # the load goes on; its outcome is not ours
            self.count_request(Outcome.CANCELLED)
            raise APIError(499, f"client disconnected while model '{name}' loaded")
        error = waiting.exception()
        if isinstance(error, ModelUnavailable):
            raise self.refusal(error) from None
        if error is not None:
            raise error


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def describe(service: ChatService) -> None:
    """Log how a model's answers are split (once, when its service is made)."""
    settings, splitter = service.settings, service.splitter
    if settings.tool_format == ToolFormat.JSON:
        calls = "in the generic JSON format (--tool-format json)"
    elif splitter.tools:
        calls = "parsed"
    else:
        calls = "not parsed (no parser for this model: tools get 400; see --tool-format json)"
    log.info(
        "%s: chat answers: reasoning %s, tool calls %s", settings.model_id,
        "separated" if splitter.thinking else "not marked by this tokenizer", calls,
    )  # fmt: skip


__all__ = ["ATTEMPTS", "ModelDirectory", "Routed", "describe"]
