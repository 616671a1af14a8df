"""What a batch runs its episodes through when they run in rollout workers: a
`WorkerRunner` (records as the workers serialised them, `RawRecord`s: the service spools
and streams them unparsed) and a `ParsedRunner` over it (`Trajectory`s, for `libra
train`). Both are `libra.rollout.batch.Runner`s; the pool is `libra.rollout.workers`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from libra.record import Trajectory
from libra.routing.base import RoutingPolicy

if TYPE_CHECKING:
    from libra.rollout.episode import EpisodeSpec
    from libra.rollout.wire import RawRecord
    from libra.rollout.workers import BatchInfo, WorkerPool


class WorkerRunner:
    """One batch's view of a `WorkerPool`: a `libra.rollout.batch.Runner` whose records
    are `RawRecord`s (for `run_episodes` and the service's batch manager)."""

    def __init__(self, pool: WorkerPool, info: BatchInfo, policy: RoutingPolicy):
        self.pool = pool
        self.info = info
        self.policy = policy
        """What `run_episodes` tells of each record in the front: the workers' policies
        route and learn, so give one that does nothing with a `RawRecord`
        (`StaticPolicy`)."""

    async def run(
        self,
        spec: EpisodeSpec,
        *,
        admitted_after_s: float = 0.0,
        on_abort: Callable[[Any], None] | None = None,
    ) -> Any:
        return await self.pool.run(self.info, spec, admitted_after_s, on_abort)


class ParsedRunner:
    """A `WorkerRunner` for a front that needs each record's content (`libra train`
    trains on it): records come back as `Trajectory`s, parsed in a thread (a record is
    as big as its episode), and reach `policy`, the front's copy of the routing policy
    (it learns from every record, as each worker's does, and is the one that is saved).
    A finished record is never dropped: cancelled while it is parsed, it goes to
    `on_abort` as it is."""

    def __init__(self, inner: WorkerRunner, policy: RoutingPolicy):
        self.inner = inner
        self.policy = policy

    async def run(
        self,
        spec: EpisodeSpec,
        *,
        admitted_after_s: float = 0.0,
        on_abort: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory:
        def aborted(raw: RawRecord) -> None:  # the batch is stopping: small and rare
            if on_abort is not None:
                on_abort(Trajectory.from_json(raw.blob))

        raw = await self.inner.run(spec, admitted_after_s=admitted_after_s, on_abort=aborted)
        parsing = asyncio.ensure_future(asyncio.to_thread(Trajectory.from_json, raw.blob))
        try:
            return await asyncio.shield(parsing)
        except asyncio.CancelledError:
            await asyncio.wait([parsing])
            if on_abort is not None and parsing.exception() is None:
                on_abort(parsing.result())
            raise

    def end_step(self, step: int) -> None:
        """Step `step` ended: the workers' policies apply what they held back (the
        front's own is told by `finish_step`)."""
        self.inner.pool.end_step(self.inner.info.env, step)


__all__ = ["ParsedRunner", "WorkerRunner"]
