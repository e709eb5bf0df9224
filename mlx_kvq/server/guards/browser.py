"""What keeps web pages from driving the server: Host, Origin and content type.

A server on loopback is reachable by every page the user's browser opens.
Three checks, in this order, as ASGI middleware in front of every route:

- Host: a server bound to loopback answers only requests whose `Host` is a
  loopback name or address (`localhost`, `*.localhost`, `127.0.0.0/8`,
  `::1`) or one of `--allowed-hosts`; anything else is DNS rebinding (a
  page's own name resolved to 127.0.0.1) and gets 403.
- Origin: a request carrying a browser's `Origin` header is answered only
  when that origin is the server's own (`http://` + its `Host`), a loopback
  origin, or one of `--allowed-origins` (`*`: any); otherwise 403, preflight
  or not. Allowed origins get CORS headers (`Access-Control-Allow-Origin`
  echoing the origin).
- Content type: a POST to the API (`/v1/...` and the bare completion paths)
  must say `application/json` (or `*/*+json`); anything else is 415. A page
  can send `text/plain` across sites without a preflight, never JSON.
"""

from __future__ import annotations

from typing import Any

from ..errors import error_response_for
from .draining import is_api_path
from .policy import GuardPolicy, host_name

CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (`application/json`, `*/*+json`)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class GuardMiddleware:
    """ASGI middleware applying a `GuardPolicy` (see the module docstring)."""

    def __init__(self, app: Any, policy: GuardPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            name = host_name(host or "")
            await _refuse(
                scope, receive, send, 403,
                f"the Host '{name}' is not allowed: this server listens on loopback and answers "
                f"loopback names only (start it with --allowed-hosts {name} to answer this name)",
                "host_not_allowed",
            )  # fmt: skip
            return
        origin = headers.get("origin")
        preflight = (
            scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        ) and origin is not None
        if origin is not None:
            if not self.policy.origin_allowed(origin, host, scope.get("scheme", "http")):
                await _refuse(
                    scope, receive, send, 403,
                    f"the origin '{origin}' is not allowed: a web page may call this server only "
                    "from its own or a loopback origin (start it with --allowed-origins to add "
                    "one)",
                    "origin_not_allowed",
                )  # fmt: skip
                return
            if preflight:
                await _preflight(scope, receive, send, origin, headers)
                return
        if (
            scope["method"] == "POST"
            and is_api_path(scope["path"])
            and not is_json(headers.get("content-type"))
        ):
            given = headers.get("content-type") or "none"
            await _refuse(
                scope, receive, send, 415,
                f"the request body must be JSON, sent with 'Content-Type: application/json' "
                f"(got {given})",
                "unsupported_media_type",
            )  # fmt: skip
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors(origin)]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _headers(scope: dict) -> dict[str, str]:
    """The request's headers by lowercase name (the first of repeated ones)."""
    out: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def _cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
    ]


async def _preflight(scope: dict, receive: Any, send: Any, origin: str, headers: dict) -> None:
    from starlette.responses import Response

    allow = [(b"access-control-allow-methods", CORS_METHODS.encode())]
    asked = headers.get("access-control-request-headers")
    if asked:
        allow.append((b"access-control-allow-headers", asked.encode("latin-1")))
    allow.append((b"access-control-max-age", str(CORS_MAX_AGE_S).encode()))
    response = Response(status_code=204)
    response.raw_headers.extend(_cors(origin) + allow)
    await response(scope, receive, send)


async def _refuse(scope: dict, receive: Any, send: Any, status: int, message: str, code: str):
    response = error_response_for(
        scope["path"], status, message, code=code, headers={"Connection": "close"}
    )
    await response(scope, receive, send)
