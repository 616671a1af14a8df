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


__all__ = ["bearer_credentials", "bearer_matches", "is_loopback"]
