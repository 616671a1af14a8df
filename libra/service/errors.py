"""Errors the HTTP layer turns into 4xx/5xx answers with a reason."""

from __future__ import annotations

from libra.errors import LibraError


class RequestError(LibraError):
    """A request the service refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, *, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close
        """Close the connection after the answer (the request was not read to its end)."""


__all__ = ["RequestError"]
