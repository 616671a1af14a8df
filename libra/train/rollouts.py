"""The rollout side of the training loop: admission, episodes, groups, batches.

    admission ──► episodes (≤ concurrency) ──► groups ──► StalenessGate ──► batch
        ▲                                        │ all-equal: dropped, slot freed
        └──────── new version (`advance`) ◄──────┴── trained and published ◄─┘

- Admission books each group into a step before its first episode starts
  (`StalenessGate`): a group that could not be trained within `max_staleness` versions
  is not started.
- Episodes run through `libra.rollout.batch.run_episodes`, the one admission path of
  Libra: at most `concurrency` in flight, every record (also the `aborted` ones a
  stopping run cancels) reaches the routing policy and the trajectory file.
- A finished group whose rewards are all equal is dropped (dynamic sampling) and its
  slot goes to a replacement; the others wait in their step's slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from libra.record import Trajectory
from libra.rollout.batch import Runner, run_episodes
from libra.rollout.episode import EpisodeSpec
from libra.rollout.run import finish_step
from libra.rollout.sink import JsonlSink
from libra.train.admission import StalenessGate
from libra.train.config import RolloutSection
from libra.train.groups import Busy, Group, Tally, TaskStream


class Changed:
    """Wakes every waiter when what it waits on may have changed (one event loop; a
    notification is a plain call, so synchronous callbacks can make it)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut


class _Counted:
    """A runner that counts its episodes in flight (the rollout's busy time)."""

    def __init__(self, runner: Runner, busy: Busy, on_count: Callable[[int], None]):
        self.runner, self.busy, self.on_count = runner, busy, on_count
        self.policy = runner.policy

    async def run(self, spec: EpisodeSpec, **kw: Any) -> Trajectory:
        self.busy.up()
        self.on_count(1)
        try:
            return await self.runner.run(spec, **kw)
        finally:
            self.busy.down()
            self.on_count(-1)


class Rollouts:
    """Training episodes for the steps the gate admits (module doc)."""

    def __init__(
        self,
        cfg: RolloutSection,
        runner: Runner,
        gate: StalenessGate,
        stream: TaskStream,
        trajectories: JsonlSink,
        on_count: Callable[[int], None] = lambda n: None,
    ):
        self.cfg, self.runner, self.gate, self.stream = cfg, runner, gate, stream
        self.trajectories = trajectories
        self.busy = Busy()
        self._counted = _Counted(runner, self.busy, on_count)
        self.changed = Changed()
        self.stopping = False
        self.blocked = False
        """Admission waits: every admissible step's slots are taken."""
        self.tally = Tally()
        self.dropped: dict[int, list[float]] = {}
        """Rewards of the all-equal groups dropped from each step (dynamic sampling)."""
        self.finished: list[Trajectory] = []
        """Records of the groups finished since the last `take_finished` (the planner's
        rollout workload)."""
        self._running: dict[str, Group] = {}
        self._ready: dict[str, Group] = {}

    @property
    def version(self) -> int:
        """The policy version admission starts groups on."""
        return self.gate.version

    def stop(self) -> None:
        """Admit no more groups; a waiting `next_batch` returns None unless ready."""
        self.stopping = True
        self.changed.notify()

    async def run(self) -> None:
        """Admit and run episodes until cancelled (the running ones then end `aborted`)."""
        await run_episodes(
            self._counted, self._specs(), concurrency=self.cfg.concurrency, emit=self._emit
        )

    async def _specs(self) -> AsyncIterator[EpisodeSpec]:
        g = self.cfg.group_size
        while True:

            def admissible() -> bool:
                self.blocked = not self.stopping and self.gate.free_step() is None
                return not self.stopping and not self.blocked

            await self.changed.wait_for(admissible)
            key = f"g{self.stream.position:06d}"
            self.gate.admit(key)
            group = Group(key, self.stream.next(), self.gate.version, g)
            self._running[key] = group
            for spec in group.specs(f"v{group.version}", int(key[1:]) * g):
                yield spec

    def _emit(self, record: Trajectory) -> None:
        self.trajectories(record)
        if record.status == "aborted":  # the run is stopping: its group is never trained
            return
        group = self._running[record.group_id]
        group.records.append(record)
        if not group.done:
            return
        del self._running[group.key]
        self.tally.add(group)
        self.finished.extend(group.records)
        equal = self.cfg.dynamic_sampling.enabled and group.all_equal()
        if equal and not self.gate.keep_equal(group.key):
            step = self.gate.bookings[group.key].step
            self.dropped.setdefault(step, []).extend(r.reward for r in group.records)
            self.gate.drop(group.key)
            self.tally.dropped += 1
        else:
            self.tally.kept_equal += equal
            self.gate.finish(group.key)
            self._ready[group.key] = group
        self.changed.notify()

    async def next_batch(self) -> list[Group] | None:
        """The groups of step `version` once all have finished; None when stopping
        first."""
        keys: list[str] | None = None

        def ready() -> bool:
            nonlocal keys
            keys = self.gate.ready()
            return keys is not None or self.stopping

        await self.changed.wait_for(ready)
        return None if keys is None else [self._ready.pop(k) for k in keys]

    async def finish_step(self, step: int) -> None:
        """Step `step` was trained: the routing policy applies what it held back and
        saves its tree (`finish_step`); rollout workers' policies are told as well."""
        await finish_step(self.runner.policy, step)
        end_step = getattr(self.runner, "end_step", None)  # a ParsedRunner's workers
        if end_step is not None:
            end_step(step)

    def advance(self) -> None:
        """Step `version` was trained and its weights published: admit on the next."""
        self.gate.trained()
        self.changed.notify()

    def take(self) -> tuple[Tally, float, list[Trajectory]]:
        """What finished since the last call: the tally, the busy seconds, the records."""
        tally, self.tally = self.tally, Tally()
        finished, self.finished = self.finished, []
        return tally, self.busy.take(), finished

    def step_rewards(self, step: int, records: list[Trajectory]) -> float:
        """Mean reward of every episode drawn for `step`: its batch and the groups
        dynamic sampling dropped from it (the batch alone over-represents mixed groups)."""
        rewards = [r.reward for r in records] + self.dropped.pop(step, [])
        return sum(rewards) / max(len(rewards), 1)


__all__ = ["Changed", "Rollouts"]
