"""Errors the HTTP layer turns into 4xx/5xx answers with a reason."""

from __future__ import annotations

from libra.errors import LibraError


class RequestError(LibraError):
    """A request the service refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


__all__ = ["RequestError"]
