"""Run many episodes with bounded concurrency; hand each record to a sink as it finishes.

Admission is the backpressure point: an episode task is created only after a slot is
free, so 10,000 queued tasks cost nothing until admitted. The TaskGroup owns every
episode task; cancelling the batch ends running episodes `aborted` (their partial
records still reach the sink) and leaks nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable
from typing import Protocol

from libra.record import Trajectory
from libra.rollout.episode import EpisodeSpec
from libra.routing.base import RoutingPolicy

ADMIT_SLICE = 16
"""Episodes admitted per event-loop iteration. An episode's first steps (setup, prompt,
render) run in the iteration after its admission, ~1 ms of loop CPU each: with 64 per
iteration, admitting 10,000 episodes made iterations of 60-100 ms for the first seconds
(the worst loop lag of the 10k control-plane bench); 16 keeps them under ~40 ms."""


class Runner(Protocol):
    """What runs episodes: `EpisodeRunner` (a libra.Env) or `libra.proxy.AgentRunner`
    (an agent function behind the OpenAI-compatible proxy)."""

    policy: RoutingPolicy

    async def run(
        self,
        spec: EpisodeSpec,
        *,
        admitted_after_s: float = 0.0,
        on_abort: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory: ...


async def run_episodes(
    runner: Runner,
    specs: Iterable[EpisodeSpec] | AsyncIterable[EpisodeSpec],
    *,
    concurrency: int,
    emit: Callable[[Trajectory], None],
    first_seq: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run `specs`; `emit(record)` is called once per episode, in finish order, with
    `record.seq` set: also for episodes cut short by cancelling the batch (`aborted`
    records of the partial episodes). The routing policy sees every record
    (`on_finish`). `specs` may be an async iterator that waits before yielding (the
    training loop admits groups as the staleness bound allows)."""
    slots = asyncio.Semaphore(concurrency)
    seq = itertools.count(first_seq)

    def finish(record: Trajectory) -> None:
        record.seq = next(seq)
        emit(record)
        runner.policy.on_finish(record)

    async def one(spec: EpisodeSpec, waited: float) -> None:
        try:
            finish(await runner.run(spec, admitted_after_s=waited, on_abort=finish))
        finally:
            slots.release()

    async with asyncio.TaskGroup() as tg, contextlib.aclosing(_aiter(specs)) as admitted:
        i = 0
        async for spec in admitted:
            i += 1
            t = clock()
            await slots.acquire()
            tg.create_task(one(spec, clock() - t), name=f"episode:{spec.id}")
            if i % ADMIT_SLICE == 0:
                await asyncio.sleep(0)  # admit in slices: keep the event loop responsive


async def _aiter(
    specs: Iterable[EpisodeSpec] | AsyncIterable[EpisodeSpec],
) -> AsyncGenerator[EpisodeSpec, None]:
    if isinstance(specs, AsyncIterable):
        source = aiter(specs)
        try:
            async for spec in source:
                yield spec
        finally:  # a generator that waits is closed with the batch, not left to GC
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()
    else:
        for spec in specs:
            yield spec


__all__ = ["ADMIT_SLICE", "Runner", "run_episodes"]
