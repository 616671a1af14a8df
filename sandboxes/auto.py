"""`auto`: Docker when its engine answers, else bubblewrap; and opening a backend by id."""

from __future__ import annotations

import asyncio
from typing import Any

from libra.sandboxes.base import Backend

from libra.errors import SandboxError


def auto(**options: Any) -> Backend:
    """A Docker backend when an engine answers a ping, else a bubblewrap backend.

    Options go to the backend chosen; ones the other backend lacks are an error only if
    that backend is chosen."""
    from libra.sandboxes.bwrap import BwrapBackend
    from libra.sandboxes.docker import DockerBackend, engine_answers

    if engine_answers() is None:
        return DockerBackend(**options)
    if why := BwrapBackend.available():
        raise SandboxError(f"no sandbox backend: no Docker engine answers, and {why}")
    return BwrapBackend(**options)


async def open_backend(name: str = "auto", **options: Any) -> Backend:
    """Resolve a backend id (`docker`, `bwrap`, `auto`, or an entry point) and start it."""
    from libra import registry

    factory = registry.sandboxes.get(name)
    try:
        backend = await asyncio.to_thread(factory, **options)
    except TypeError as e:
        raise SandboxError(f"sandbox backend {name!r}: bad options {sorted(options)}: {e}") from e
    await backend.start()
    return backend


__all__ = ["auto", "open_backend"]
