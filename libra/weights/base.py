"""The weight-sync protocol (see the package doc)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from libra.errors import WeightsNotDelivered


@dataclass(frozen=True, slots=True)
class Weights:
    """A policy version and where an engine can start from it."""

    version: int
    """Policy version (-1: an engine started here must load the current one first)."""
    folder: str
    """An HF model folder holding these weights."""


class WeightSync(Protocol):
    """Moves each new policy version from the trainer into every serving endpoint."""

    @property
    def current(self) -> Weights:
        """The newest version every registered endpoint serves."""
        ...

    def start_weights(self) -> Weights:
        """What a new engine starts from (a folder that stays while it starts)."""
        ...

    async def publish(self, version: int) -> float:
        """Take the trainer's weights as `version` into every registered endpoint, one
        at a time (the others keep serving); returns the seconds it took. An endpoint
        that fails to take them leaves the pool; once the others have them, raises
        `WeightsNotDelivered` naming it."""
        ...

    async def attach(self, bucket: str, url: str, started_on: Weights) -> int:
        """Register the engine at `url` (started on `started_on`) in `bucket` at the
        current version, loading it first when a newer one was published meanwhile;
        returns the version it serves."""
        ...

    async def detach(self, url: str, drain_timeout_s: float) -> int:
        """Stop sending turns and weights to `url`: its turns in flight finish (up to
        `drain_timeout_s`), then it leaves the pool; returns the turns cut."""
        ...


def not_delivered(version: int, lost: list[tuple[str, str]]) -> WeightsNotDelivered:
    where = "; ".join(f"{url}: {why}" for url, why in lost)
    return WeightsNotDelivered(f"weights v{version} not delivered to {where}", lost)


__all__ = ["WeightSync", "Weights", "not_delivered"]
