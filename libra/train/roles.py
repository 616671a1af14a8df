"""Role switches of a hybrid worker, sequenced by the loop across the fleet and the
trainer (neither calls the other). Design: docs/train.md, "Hybrid workers".

rollout -> training
    1. its engine stops admitting turns; the turns it runs finish there, each episode's
       *next* turn goes to a sibling engine, which re-prefills its context (the episode
       migrates at a turn boundary, nothing is lost); the endpoint leaves the pool and
       the engine stops, freeing its devices for training (`Fleet.retire`);
    2. the trainer adds it as a hybrid replica: at the next step boundary it registers,
       is admitted, fetches a snapshot from a live peer in the background and trains
       from the step after it caught up.
training -> rollout
    1. the trainer removes it: it leaves after its next update; on the fleet's GPUs the
       engine waits for that (its replica's state holds their memory until it is gone);
    2. an engine starts on its devices and is registered in the first bucket at the
       current version (`Fleet.serve`: a version published meanwhile is loaded first).
"""

from __future__ import annotations

import asyncio
import time

from libra.train.handle import TrainerHandle
from libra.train.workers import Fleet, Worker


async def to_training(fleet: Fleet, trainer: TrainerHandle, w: Worker) -> dict[str, float]:
    """rollout -> training. Returns measured durations."""
    t0 = time.monotonic()
    took = await fleet.retire(w)
    t1 = time.monotonic()
    left = fleet.placement.slots.get(w.id)  # on Ray: train on the node its engine left
    gpus = fleet.train_gpus.get(w.id)  # on the fleet's GPUs: the ones its engine left
    await trainer.add_hybrid(w.id, left.node if left is not None else None, gpus)
    w.role = "train"
    return took | {"register_s": time.monotonic() - t1, "total_s": time.monotonic() - t0}


async def to_rollout(
    fleet: Fleet, trainer: TrainerHandle, w: Worker, bucket: str
) -> dict[str, float]:
    """training -> rollout. Returns measured durations."""
    w.role = "switching"
    t0 = time.monotonic()
    await trainer.remove_hybrid(w.id)
    if fleet.train_gpus.get(w.id):
        await _gone(trainer, w.id)
    t1 = time.monotonic()
    start_s = await fleet.serve(w, bucket)
    return {"leave_s": t1 - t0, "engine_start_s": start_s, "total_s": time.monotonic() - t0}


async def _gone(trainer: TrainerHandle, rid: str, poll_s: float = 0.2) -> None:
    """Until replica `rid` has left (or was dropped): its processes are reaped, its
    GPUs free. The loop's steps go on meanwhile; the leave rides the next one."""
    while True:
        states = {r.id: r.state for r in await trainer.replicas()}
        if states.get(rid, "left") in ("left", "dropped"):
            return
        await asyncio.sleep(poll_s)


__all__ = ["to_rollout", "to_training"]
