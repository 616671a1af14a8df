"""Workers and their engines: core rollout instances, core training replicas, hybrids.

The `Fleet` starts and stops the engines of the workers that serve rollouts, on the
devices the run's placement gave them (`libra.cluster.placement`), and registers each
with the weight sync (`libra.weights`), which owns which endpoints serve which version.
It never calls the trainer or the loop: role switches (`libra.train.roles`) and layout
changes (`libra.train.relayout`) are sequenced by the loop, which drives the fleet and
the trainer side by side.

- `serve(w, bucket)`: start `w`'s engine at the bucket's TP size on its slot, on the
  weights a new engine starts from, then register it at the current version (a version
  published meanwhile is loaded first).
- `retire(w)`: no new turns go to its engine, the turns it runs finish there (up to
  `drain_timeout_s`; later ones are retried on a sibling), the endpoint leaves the pool,
  the engine stops. The worker keeps its devices (a hybrid comes back to them).
- `add_core(bucket)` / `remove(w)`: a layout change starts a new core instance / stops
  one for good and frees its devices.
- `replace(w)`: an engine that died, or that a publication could not reach, is stopped
  and a new one started on the same devices at the current version (`watch`,
  `replace_lost`; `restarts` per worker, then the run stops in one line).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from libra.cluster.engines import (
    Engine,
    EngineLauncher,
    engine_down,
    kill_engine,
    stop_engine,
)
from libra.cluster.placement import Placement
from libra.errors import EndpointDown
from libra.weights import Weights, WeightSync

Role = Literal["rollout", "train", "switching"]
OnEvent = Callable[..., Any]
"""`on_event(name, **fields)`: where the fleet reports what it did unasked (the run's
event log)."""


@dataclass(slots=True)
class Worker:
    id: str
    kind: Literal["core-rollout", "core-train", "hybrid"]
    role: Role
    bucket: str | None = None
    engine: Engine | None = None


class Fleet:
    """The run's workers. Engines serve the weight sync's current version."""

    def __init__(
        self,
        workers: list[Worker],
        *,
        launcher: EngineLauncher,
        placement: Placement,
        weights: WeightSync,
        bucket_tp: dict[str, int],
        log_dir: Path,
        drain_timeout_s: float = 30.0,
        restarts: int = 2,
        train_gpus: dict[str, list[int]] | None = None,
    ):
        self.workers = workers
        self.launcher = launcher
        self.placement = placement
        self.train_gpus = train_gpus or {}
        """worker -> the GPUs its training replica takes when the trainer trains on the
        fleet's GPUs (`libra.train.placement.trainer_gpus`); absent: the trainer
        places its replicas itself."""
        self.weights = weights
        self.bucket_tp = bucket_tp
        """TP size of each bucket's instances."""
        self.log_dir = log_dir
        self.drain_timeout_s = drain_timeout_s
        self.engine_start_s: list[float] = []
        """Measured engine start times (the planner's reconfiguration cost)."""
        self._used = {w.id for w in workers}
        self.restarts = restarts
        """Engines a worker may lose (crash, weights not delivered) and have replaced."""
        self.restarts_left: dict[str, int] = {}

    # -- views ------------------------------------------------------------------------

    def by_role(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"rollout": [], "train": []}
        for w in self.workers:
            out.setdefault(w.role, []).append(w.id)
        return out

    def counts(self) -> dict[str, int]:
        return {r: len(ids) for r, ids in self.by_role().items()}

    def hybrids(self, role: Role) -> list[Worker]:
        return [w for w in self.workers if w.kind == "hybrid" and w.role == role]

    # -- engines ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start and register the engines of every worker in the rollout role, on the
        current weights: their folder, or (weights that live only in the trainer's
        memory, as when a broadcast run resumes) the start folder, then a transfer."""
        now = self.weights.current
        if not now.folder:
            now = self.weights.start_weights()
        rollout = [w for w in self.workers if w.role == "rollout"]
        try:  # one failed start cancels the others (each stops its engine)
            async with asyncio.TaskGroup() as tg:
                for w in rollout:
                    tg.create_task(self._serve(w, w.bucket or "", now), name=f"start-{w.id}")
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None

    async def serve(self, w: Worker, bucket: str) -> float:
        """Start `w`'s engine in `bucket` and register it (module doc); returns the
        engine's start time."""
        start_s, _ = await self._serve(w, bucket, self.weights.start_weights())
        return start_s

    async def _serve(self, w: Worker, bucket: str, weights: Weights) -> tuple[float, int]:
        """(engine start seconds, version it serves)."""
        tp = self.bucket_tp.get(bucket, 1)
        slot = self.placement.assign(w.id, tp)
        engine = await self.launcher.start(w.id, tp, slot, weights.folder, self.log_dir)
        self.placement.placed(w.id, engine.slot)  # Ray picks the node
        try:
            version = await self.weights.attach(bucket, engine.url, weights)
        except BaseException:
            await stop_engine(engine, self.launcher.stop_grace_s)
            raise
        w.engine, w.bucket, w.role = engine, bucket, "rollout"
        self.engine_start_s.append(engine.start_s)
        return engine.start_s, version

    async def retire(self, w: Worker) -> dict[str, float]:
        """Take `w` out of rollout (module doc). Returns measured durations."""
        assert w.engine is not None
        w.role = "switching"
        t0 = time.monotonic()
        left = await self.weights.detach(w.engine.url, self.drain_timeout_s)
        t1 = time.monotonic()
        engine, w.engine = w.engine, None  # detached first: `watch` sees no death
        await stop_engine(engine, self.launcher.stop_grace_s)
        return {"drain_s": t1 - t0, "turns_cut": float(left), "stop_s": time.monotonic() - t1}

    # -- layout changes -----------------------------------------------------------------

    def _new_id(self, prefix: str) -> str:
        n = 0
        while f"{prefix}{n}" in self._used:
            n += 1
        self._used.add(f"{prefix}{n}")
        return f"{prefix}{n}"

    async def add_core(self, bucket: str, near: str | None = None) -> tuple[Worker, int]:
        """A new core rollout instance in `bucket` (on devices a `remove` freed; on a
        cluster, on node `near` if it has room); returns it and the version it serves."""
        w = Worker(self._new_id("rollout"), "core-rollout", "switching", bucket)
        if near is not None:
            self.placement.prefer(w.id, near)
        self.workers.append(w)
        try:
            _, version = await self._serve(w, bucket, self.weights.start_weights())
        except BaseException:
            self.workers.remove(w)
            self.placement.release(w.id)
            raise
        return w, version

    async def remove(self, w: Worker) -> dict[str, float]:
        """Stop `w`'s instance for good and free its devices. Returns durations."""
        took = await self.retire(w)
        self.placement.release(w.id)
        self.workers.remove(w)
        return took

    # -- supervision ----------------------------------------------------------------------

    async def watch(self, interval_s: float = 1.0, on_event: OnEvent | None = None) -> None:
        """Runs until cancelled. An engine that exits while serving (a crashed vLLM
        engine core takes its API server down), or is lost with its node, is replaced
        on its devices (`replace`; a Ray engine where Ray finds room);
        when a worker has used up its restarts, or a restart fails, raises
        `EndpointDown` (with the log's last error), so a run fails in one line instead
        of waiting on a bucket with no engine."""
        while True:
            for w in list(self.workers):
                e = w.engine
                if e is None or w.role != "rollout":
                    continue
                why = await engine_down(e)
                if why is not None:
                    await self.replace(w, why, on_event)
            await asyncio.sleep(interval_s)

    async def replace_lost(self, lost: list[tuple[str, str]], on_event: OnEvent | None) -> None:
        """Replace the engines a publication could not reach (`WeightsNotDelivered`):
        they left the pool already; their weights may be half new."""
        for url, why in lost:
            for w in self.workers:
                if w.engine is not None and w.engine.url == url and w.role == "rollout":
                    await self.replace(w, f"weights not delivered: {why}", on_event)

    async def replace(self, w: Worker, why: str, on_event: OnEvent | None = None) -> None:
        """Stop `w`'s engine (dead, or no longer trusted) and start a new one on the same
        devices, registered at the current version; at most `restarts` per worker."""
        engine = w.engine
        assert engine is not None
        left = self.restarts_left.get(w.id, self.restarts)
        if left <= 0:
            raise EndpointDown(f"{engine.kind} engine of {w.id} {why} (no restart left: "
                               f"{self.restarts} used)", url=engine.url)  # fmt: skip
        self.restarts_left[w.id] = left - 1
        w.role = "switching"  # no role switch or relayout picks it meanwhile
        await self.weights.detach(engine.url, 0.0)  # its turns fail over to siblings
        w.engine = None
        await stop_engine(engine, self.launcher.stop_grace_s)
        if on_event is not None:
            on_event("engine-lost", worker=w.id, url=engine.url, node=engine.slot.node, why=why,
                     restarts_left=left - 1)  # fmt: skip
        t0 = time.monotonic()
        try:
            _, version = await self._serve(w, w.bucket or "", self.weights.start_weights())
        except Exception as e:
            raise EndpointDown(f"{engine.kind} engine of {w.id} {why}; its restart failed: "
                               f"{e}", url=engine.url) from e  # fmt: skip
        if on_event is not None and w.engine is not None:
            on_event("engine-restarted", worker=w.id, url=w.engine.url, node=w.engine.slot.node,
                     version=version, start_s=round(time.monotonic() - t0, 2))  # fmt: skip

    async def close(self) -> None:
        """Stop every engine; a cancelled close still kills and reaps each one
        (`libra.cluster.process.stop`)."""
        engines = [w.engine for w in self.workers if w.engine is not None]
        for w in self.workers:
            w.engine = None
        grace = self.launcher.stop_grace_s
        await asyncio.gather(*(stop_engine(e, grace) for e in engines))

    def kill_now(self) -> None:
        """Last resort (synchronous): SIGKILL every engine still running."""
        for w in self.workers:
            if w.engine is not None:
                kill_engine(w.engine)


__all__ = ["Fleet", "Role", "Worker"]
