"""A rollout-side layout change: core instances restarted at other TP sizes.

The planner may choose another *layout* of the core rollout devices: instances per
bucket, each bucket one TP size (`libra.train.planning.layouts`). `relayout` moves the
fleet there one instance at a time, on the devices the old instances free:

1. pick an instance of a bucket that has more than the layout wants; stop admitting
   turns to it and let the turns it runs finish there, stop its engine and free its
   devices (`Fleet.remove`);
2. as soon as enough devices are free for an instance of a bucket that has fewer than
   the layout wants, start it there (on a Ray cluster: asking for the node the first
   of those stops freed, Ray's soft target) at that bucket's TP size on the current weights and
   register it in the bucket at their version (`Fleet.add_core`: a version published
   meanwhile is loaded first); instances whose devices are free at the same time (two
   TP-1 on the devices of one TP-2) start together;
3. repeat until every bucket has its count.

Instances are only ever taken from buckets above their target, and every target is at
least one, so **no bucket is ever left without a serving instance**: a turn bound for
a bucket always has a server there (it may wait for a slot), and an episode whose turn
ran on a stopped instance continues on a sibling at its next turn (it re-prefills its
context), as in a role switch. Nothing is routed elsewhere and no episode is lost. The
per-turn version stamps stay right because registration happens under the weight sync's
lock at the version actually loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from libra.train.workers import Fleet

Note = Callable[..., object]
"""`note(event, **fields)`: where each instance's stop and start is reported."""


def plan_moves(have: Counter[str], want: dict[str, int], tp: dict[str, int]) -> list[str]:
    """The order of a layout change as `-bucket` (stop one instance of it) and `+bucket`
    (start one) steps: each start comes right after the stops that free its devices.
    Raises ValueError when `want` uses other devices than `have` or empties a bucket."""
    devices = sum(tp[b] * n for b, n in have.items())
    wanted = sum(tp[b] * n for b, n in want.items())
    if devices != wanted:
        raise ValueError(f"layout {want} needs {wanted} devices, the core instances hold {devices}")
    if any(want.get(b, 0) < 1 for b in tp):
        raise ValueError(f"layout {want} leaves a bucket without an instance")
    stops = [b for b in tp for _ in range(max(have.get(b, 0) - want[b], 0))]
    starts = [b for b in tp for _ in range(max(want[b] - have.get(b, 0), 0))]
    starts.sort(key=lambda b: -tp[b])  # the widest first: it needs the most freed devices
    steps: list[str] = []
    free = 0
    for b in starts:
        while free < tp[b]:
            gone = stops.pop(0)
            steps.append(f"-{gone}")
            free += tp[gone]
        steps.append(f"+{b}")
        free -= tp[b]
    return steps


async def relayout(fleet: Fleet, want: dict[str, int], note: Note) -> dict[str, Any]:
    """Move the core rollout instances to `want` (instances per bucket), instance by
    instance (module doc). Returns the measured durations."""
    core = [w for w in fleet.workers if w.kind == "core-rollout" and w.role == "rollout"]
    have = Counter(w.bucket or "" for w in core)
    tp = {b: fleet.bucket_tp.get(b, 1) for b in want}
    steps = plan_moves(have, want, tp)
    t0 = time.monotonic()
    restarts: list[float] = []
    freed_at, fresh = t0, True  # fresh: the next stop frees devices for a new batch
    starts: list[str] = []

    freed: list[str] = []  # nodes of stopped instances (on a cluster: asked for again)

    async def start(bucket: str) -> None:
        w, version = await fleet.add_core(bucket, freed.pop(0) if freed else None)
        core.append(w)
        # its devices were idle from the stop that freed the first of them
        restarts.append(time.monotonic() - freed_at)
        assert w.engine is not None
        note("instance-started", worker=w.id, bucket=bucket, tp=tp[bucket],
             node=w.engine.slot.node, engine_start_s=w.engine.start_s,
             version=version)  # fmt: skip

    for i, step in enumerate(steps):
        bucket = step[1:]
        if step[0] == "-":
            w = next(w for w in reversed(core) if w.bucket == bucket and w.engine is not None)
            if fresh:
                freed_at, fresh = time.monotonic(), False
            assert w.engine is not None
            freed.append(w.engine.slot.node)
            took = await fleet.remove(w)
            core.remove(w)
            note("instance-stopped", worker=w.id, bucket=bucket, tp=tp[bucket], **took)
            continue
        starts.append(bucket)
        if i + 1 == len(steps) or steps[i + 1][0] == "-":  # start what the stops freed
            async with asyncio.TaskGroup() as tg:
                for b in starts:
                    tg.create_task(start(b))
            starts, fresh = [], True
    return {
        "steps": steps,
        "restart_s": max(restarts, default=0.0),
        "total_s": time.monotonic() - t0,
    }


__all__ = ["plan_moves", "relayout"]
