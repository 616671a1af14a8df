"""Bearer tokens on HTTP requests, checked the same way by the service and the proxy.

The scheme is case-insensitive (RFC 9110, 11.1: `bearer` is `Bearer`). aiohttp decodes
header bytes that are not UTF-8 with `surrogateescape`, so encoding them back the same
way gives the bytes the client sent: a malformed header is a wrong token, never a crash.
Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress


def bearer_credentials(header: str | None) -> bytes | None:
    """The credentials of an `Authorization: Bearer ...` header as raw bytes, or None
    when the header is absent or names another scheme."""
    if not header:
        return None
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip().encode("utf-8", "surrogateescape")


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether the header carries exactly `token` as a bearer token."""
    got = bearer_credentials(header)
    return got is not None and hmac.compare_digest(got, token.encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostname(netloc: str) -> str:
    """The host of `host[:port]` / `[v6]:port` ("" when it does not parse)."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(f"//{netloc}").hostname or ""
    except ValueError:
        return ""


def page_refusal(origin: str | None, host: str | None, *, loopback_only: bool) -> str | None:
    """Why a request that a web page may have sent is refused (None: it is not).

    A browser sends `Origin` with a cross-site request, and a plain POST (a form,
    text/plain) needs no preflight, so any page the operator opened could call a server
    on loopback; programs (the client, curl, a trainer) send no `Origin`. A page may
    also rebind its own name to 127.0.0.1 (DNS rebinding): its requests are then
    same-origin, with no `Origin`, but its `Host` is its name, so a server that answers
    without a token (`loopback_only`) refuses a `Host` that is not a loopback name."""
    if origin is not None:
        try:
            named = origin.split("://", 1)[1]
        except IndexError:
            named = ""
        if not (named and named == host and is_loopback(_hostname(named))):
            return (f"cross-site request from {origin[:100]!r} refused: call the server "
                    "from a program, not from a web page")  # fmt: skip
    if loopback_only and host is not None and not is_loopback(_hostname(host)):
        return (
            f"request for host {host[:100]!r} refused: without a token this server "
            "answers only requests addressed to a loopback name (127.0.0.1, localhost, "
            "[::1]), so that a web page cannot reach it under a name of its own"
        )
    return None


__all__ = ["bearer_credentials", "bearer_matches", "is_loopback", "page_refusal"]
