"""Which hosts and browser origins the server answers: the policy its
flags declare (`--allowed-hosts`, `--allowed-origins`), without the HTTP
stack; `browser.GuardMiddleware` applies it."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

ANY = "*"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether the host name or address `host` (no port) can only mean this machine."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name or address of a `Host` header value, without its port."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def normalize_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


@dataclass(frozen=True)
class GuardPolicy:
    """Which hosts and origins are answered.

    `hosts`: host names (no port) accepted besides loopback ones, `("*",)`
    for any, or None to accept any `Host` (a server not bound to loopback
    without `--allowed-hosts`). `origins`: browser origins accepted besides
    the server's own and loopback ones, `("*",)` for any.
    """

    hosts: tuple[str, ...] | None = ()
    origins: tuple[str, ...] = ()

    @classmethod
    def for_bind(
        cls, bind_host: str, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str]
    ) -> GuardPolicy:
        """The policy of a server bound to `bind_host`: the Host check applies when it
        listens on loopback or when `allowed_hosts` is given."""
        hosts = None
        if allowed_hosts is not None:
            hosts = tuple(h.strip().lower() for h in allowed_hosts if h.strip())
        elif is_loopback(bind_host):
            hosts = ()
        origins = tuple(normalize_origin(o) for o in allowed_origins if o.strip())
        return cls(hosts, origins)

    def host_allowed(self, host: str | None) -> bool:
        if self.hosts is None or ANY in self.hosts or host is None:
            return True  # no Host at all is HTTP/1.0 from a program, never a browser
        name = host_name(host)
        return is_loopback(name) or name in self.hosts

    def origin_allowed(self, origin: str, host: str | None, scheme: str) -> bool:
        origin = normalize_origin(origin)
        if ANY in self.origins or origin in self.origins:
            return True
        if host is not None and origin == f"{scheme}://{host.strip().lower()}":
            return True  # the server's own page
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and is_loopback(parts.hostname or "")
