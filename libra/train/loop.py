"""The asynchronous GRPO loop: admission, episodes, groups, training steps, publishing,
replanning, validation. One TaskGroup owns every task.

    admission ──► episodes (≤ concurrency) ──► groups ──► StalenessGate ──► batch
        ▲                                        │ all-equal: dropped, slot freed
        └──── new version (weights published) ◄──┴── trainer.step ◄──────────┘

- Admission books each group into a step before its first episode starts
  (`StalenessGate`): a group that could not be trained within `max_staleness` versions
  is not started.
- A step trains as soon as its slots hold finished groups; rollout for the next steps
  keeps running meanwhile (asynchronous RL).
- After a step the new weights are loaded into every engine, one at a time; turns in
  flight finish on the old weights and every turn records the version that produced it
  (`Fleet.publish`). Only then does the gate advance the version, so a group's admitted
  version never exceeds what its first turn runs on.
- Validation of version v runs right after v is published; v+1 is published only when
  it finished, so every validation episode runs on one version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from libra.planner import Signals, WorkloadStats
from libra.record import Trajectory
from libra.rollout.batch import Runner, run_episodes
from libra.rollout.run import finish_step
from libra.rollout.sink import JsonlSink
from libra.rollout.tasks import episode_specs
from libra.train.admission import StalenessGate
from libra.train.config import TrainConfig
from libra.train.display import Display, View
from libra.train.fleet import Fleet, TrainerHandle
from libra.train.groups import Busy, Group, Tally, TaskStream
from libra.train.planning import Assignment, Replanner, SwitchCosts, Workload
from libra.train.relayout import relayout
from libra.train.report import Report


@dataclass(slots=True)
class LoopState:
    """What survives a resume besides the trainer checkpoint (see `libra.train.state`)."""

    switches: int = 0
    costs: SwitchCosts = field(default_factory=lambda: SwitchCosts(10.0, 10.0))
    val_version: int | None = None
    val_reward: float | None = None
    first_reward: float | None = None


class Loop:
    def __init__(
        self,
        *,
        cfg: TrainConfig,
        runner: Runner,
        val_runner: Runner | None,
        val_tasks: list[dict[str, Any]],
        fleet: Fleet,
        trainer: TrainerHandle,
        gate: StalenessGate,
        stream: TaskStream,
        report: Report,
        display: Display,
        view: View,
        replanner: Replanner | None,
        checkpoint: Callable[[], Awaitable[None]],
        state: LoopState,
        trajectories: JsonlSink | None = None,
        bucket: str = "tp1",
    ):
        self.cfg, self.runner, self.val_runner = cfg, runner, val_runner
        self.val_tasks = val_tasks
        self.fleet, self.trainer, self.gate, self.stream = fleet, trainer, gate, stream
        self.report, self.display, self.view = report, display, view
        self.replanner, self.checkpoint, self.state = replanner, checkpoint, state
        self.trajectories = trajectories
        self.bucket = bucket
        self.cond = asyncio.Condition()
        self.finished: dict[str, Group] = {}
        self.interval: list[Trajectory] = []
        self.tally = Tally()
        self.dropped: dict[int, list[float]] = {}
        """Rewards of the all-equal groups dropped from each step (dynamic sampling)."""
        self.busy = Busy()
        self.seq = itertools.count()
        self.stopping = False
        self.blocked = False
        self._tg: asyncio.TaskGroup | None = None
        self._val: asyncio.Task[None] | None = None
        self._switch: asyncio.Task[None] | None = None
        self._to_train_s = 0.0
        self.checkpointed = gate.version
        """Version of the last checkpoint written by this loop."""

    # -- control ----------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ctrl-C: stop admitting, finish the step in progress, checkpoint, exit."""
        self.stopping = True
        self.view.note = (
            "stopping: finishing the step in progress, then saving a checkpoint "
            "(Ctrl-C again stops at once; resume with the same command)"
        )
        asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def run(self) -> str:
        """Train to `cfg.steps`; returns `done` or `interrupted`."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            admit = tg.create_task(self._admit(), name="libra-admission")
            draw = tg.create_task(self._draw(), name="libra-display")
            try:
                if self.gate.version == 0 or self.state.val_version != self.gate.version:
                    self._start_validation(self.gate.version)
                outcome = await self._train()
                if self._val is not None and outcome == "done":
                    await self._val
            finally:
                for t in (admit, draw, self._switch, self._val):
                    if t is not None:
                        t.cancel()
        return outcome

    # -- admission and episodes -------------------------------------------------------

    async def _admit(self) -> None:
        r = self.cfg.rollout
        slots = asyncio.Semaphore(r.concurrency)
        async with asyncio.TaskGroup() as episodes:
            while True:
                async with self.cond:
                    while self.stopping or self.gate.free_step() is None:
                        self.blocked = not self.stopping
                        await self.cond.wait()
                    self.blocked = False
                    key = f"g{self.stream.position:06d}"
                    self.gate.admit(key)
                    group = Group(key, self.stream.next(), self.gate.version, r.group_size)
                for spec in group.specs(f"v{group.version}", int(key[1:]) * r.group_size):
                    await slots.acquire()
                    episodes.create_task(self._episode(group, spec, slots), name=spec.id)

    async def _episode(self, group: Group, spec: Any, slots: asyncio.Semaphore) -> None:
        self.busy.up()
        self.view.in_flight += 1
        try:
            rec = await self.runner.run(spec)
        finally:
            slots.release()
            self.busy.down()
            self.view.in_flight -= 1
        rec.seq = next(self.seq)
        self.runner.policy.on_finish(rec)
        if self.trajectories is not None:
            self.trajectories(rec)
        group.records.append(rec)
        if group.done:
            await self._group_done(group)

    async def _group_done(self, group: Group) -> None:
        async with self.cond:
            self.tally.add(group)
            self.interval.extend(group.records)
            equal = self.cfg.rollout.dynamic_sampling.enabled and group.all_equal()
            if equal and not self.gate.keep_equal(group.key):
                dropped = self.dropped.setdefault(self.gate.bookings[group.key].step, [])
                dropped += [r.reward for r in group.records]
                self.gate.drop(group.key)
                self.tally.dropped += 1
            else:
                self.tally.kept_equal += equal
                self.gate.finish(group.key)
                self.finished[group.key] = group
            self.cond.notify_all()

    # -- training ---------------------------------------------------------------------

    async def _next_batch(self) -> list[Group] | None:
        async with self.cond:
            while (keys := self.gate.ready()) is None:
                if self.stopping:
                    return None
                await self.cond.wait()
            return [self.finished.pop(k) for k in keys]

    async def _train(self) -> str:
        t_prev = time.monotonic()
        while self.gate.version < self.cfg.steps:
            t_wait = time.monotonic()
            batch = await self._next_batch()
            if batch is None:
                return "interrupted"
            v = self.gate.version
            records = [r for g in batch for r in g.records]
            t0 = time.monotonic()
            rep = await self.trainer.call(self.trainer.trainer.step, records)
            t1 = time.monotonic()
            if self._val is not None:  # validation of v runs on v's weights only
                await self._val
            publish_s = await self.fleet.publish(rep.version, rep.published)
            async with self.cond:
                self.gate.trained()
                self.cond.notify_all()
            await finish_step(self.runner.policy, v)
            now = time.monotonic()
            row = self._row(rep, batch, records, v, now - t_prev, t0 - t_wait, t1 - t0, publish_s)
            t_prev = now
            self.report.step(row)
            self.display.step(row)
            self._update_view(row)
            self._after_step(row, records)
            due = rep.version % self.cfg.validation.every == 0 or rep.version == self.cfg.steps
            if due:
                self._start_validation(rep.version)
            if rep.version % self.cfg.report.checkpoint_every == 0 or self.stopping:
                await self.checkpoint()
                self.checkpointed = rep.version
            if self.stopping:
                return "interrupted"
        return "done"

    def _row(
        self,
        rep: Any,
        batch: list[Group],
        records: list[Trajectory],
        v: int,
        step_s: float,
        wait_s: float,
        train_s: float,
        publish_s: float,
    ) -> dict[str, Any]:
        t = self.tally
        stale = [v - min((x.policy_version for x in r.turns), default=r.step) for r in records]
        busy = self.busy.take()
        per_batch = len(records) / max(t.episodes, 1)
        row = {
            "step": rep.version,
            "time_s": round(time.monotonic() - self.view.phase_started, 2),
            "reward": self._step_reward(v, records),
            "reward_batch": rep.reward_mean,
            "reward_finished": t.reward,
            "val_reward": self.state.val_reward,
            "val_version": self.state.val_version,
            "tokens_per_s": sum(r.total_tokens for r in records) / step_s,
            "gen_tokens_per_s": t.model_tokens / step_s,
            "train_tokens_per_s": rep.tokens_per_s,
            "roles": self.fleet.counts(),
            "workers": self.fleet.by_role(),
            "step_s": step_s,
            "wait_s": wait_s,
            "train_s": train_s,
            "publish_s": publish_s,
            "rollout_busy_s": busy,
            "rollout_s": busy * per_batch,
            "episodes": t.episodes,
            "not_ok": t.not_ok,
            "groups": len(batch),
            "groups_dropped": t.dropped,
            "groups_kept_equal": t.kept_equal,
            "staleness_mean": sum(stale) / max(len(stale), 1),
            "staleness_max": max(stale, default=0),
            "stale_dropped": rep.dropped_records.get("stale", 0),
            "loss": rep.loss,
            "kl": rep.kl,
            "clip_frac": rep.clip_frac,
            "mismatch_kl": rep.mismatch_kl,
            "grad_norm": rep.grad_norm,
            "lr": rep.lr,
            "samples": rep.samples,
            "train_tokens": rep.tokens,
            "migrations": t.migrations,
            "switches": self.state.switches,
            "replicas": {r.id: r.state for r in rep.replicas},
        }
        for e in rep.events:
            self.report.event(
                f"trainer-{e.kind}",
                replica=e.replica,
                update=e.update,
                join_latency_s=e.join_latency_s,
                core_stall_s=e.stall_s,
            )
            if e.kind == "joined" and e.join_latency_s is not None:
                # the hybrid's time out of service: the switch itself, then catching up
                c = self.state.costs
                self.state.costs = dataclasses.replace(
                    c, to_train_s=self._to_train_s + e.join_latency_s
                )
                row["join_latency_s"] = e.join_latency_s
        return row

    def _step_reward(self, v: int, records: list[Trajectory]) -> float:
        """Mean reward of every episode drawn for step `v`: its batch and the groups
        dynamic sampling dropped from it (the batch alone over-represents mixed groups)."""
        rewards = [r.reward for r in records] + self.dropped.pop(v, [])
        return sum(rewards) / max(len(rewards), 1)

    def _update_view(self, row: dict[str, Any]) -> None:
        v = self.view
        v.step, v.reward = row["step"], row["reward"]
        if self.state.first_reward is None:
            self.state.first_reward = row["reward"]
        v.reward_first = self.state.first_reward
        v.kept, v.dropped = row["groups"], row["groups_dropped"]
        v.tokens_per_s, v.gen_tokens_per_s = row["tokens_per_s"], row["gen_tokens_per_s"]
        v.train_tokens_per_s = row["train_tokens_per_s"]
        v.migrations += row["migrations"]
        self.tally = Tally()

    # -- planner ----------------------------------------------------------------------

    def _after_step(self, row: dict[str, Any], records: list[Trajectory]) -> None:
        work_records, self.interval = self.interval, []
        if self.replanner is None or (self._switch is not None and not self._switch.done()):
            return
        engines = sum(1 for w in self.fleet.workers if w.role == "rollout")
        signals = Signals(
            step=row["step"],
            rollout_s=row["rollout_s"],
            train_s=row["train_s"],
            decode_slots=max(engines, 1) * self.cfg.fleet.engine_max_num_seqs,
        )
        work = Workload(
            rollout=WorkloadStats.from_records(work_records or records),
            train=WorkloadStats.from_records(records),
        )
        remaining = self.cfg.steps - row["step"]
        out = self.replanner.consider(signals, work, remaining, self.state.costs)
        if out is None:
            return
        decision, target = out
        entry = self.replanner.log[-1]
        self.report.decision(entry)
        numbers = (
            f"gain {decision.predicted_gain_s:,.0f} s vs cost {decision.reconfig_cost_s:,.1f} s"
        )
        if decision.apply:
            note = f"moving to {target.train} hybrid(s) training ({numbers})"
            if target.layout and target.layout != self._layout():
                note = f"{note}, core layout {self.replanner.key(target)}"
        else:
            note = f"kept {self.replanner.current.train} hybrid(s) training ({decision.reason})"
        self.view.last_decision = f"v{row['step']}: {note}"
        if decision.apply and self._tg is not None:
            self._switch = self._tg.create_task(self._apply(target), name="libra-switch")

    async def _apply(self, target: Assignment) -> None:
        while len(self.fleet.hybrids("train")) < target.train:
            w = self.fleet.hybrids("rollout")[0]
            self.report.event("switch-start", worker=w.id, to="train")
            took = await self.fleet.to_training(w)
            self.state.switches += 1
            self.view.switches = self.state.switches
            self.report.event("switch-done", worker=w.id, to="train", **took)
            c = self.state.costs
            self._to_train_s = took["total_s"]
            self.state.costs = dataclasses.replace(c, to_train_s=took["total_s"])
        while len(self.fleet.hybrids("train")) > target.train:
            w = self.fleet.hybrids("train")[-1]
            self.report.event("switch-start", worker=w.id, to="rollout")
            took = await self.fleet.to_rollout(w, self.bucket)
            self.state.switches += 1
            self.view.switches = self.state.switches
            self.report.event("switch-done", worker=w.id, to="rollout", **took)
            c = self.state.costs
            self.state.costs = dataclasses.replace(c, to_rollout_s=took["total_s"])
        if target.layout and target.layout != self._layout():
            await self._relayout(target.layout)

    def _layout(self) -> tuple[int, ...]:
        """Core rollout instances per bucket now (with the replanner's buckets)."""
        if self.replanner is None or not self.replanner.shape.buckets:
            return ()
        core = [w.bucket for w in self.fleet.workers if w.kind == "core-rollout"]
        return tuple(core.count(b) for b, _ in self.replanner.shape.buckets)

    async def _relayout(self, layout: tuple[int, ...]) -> None:
        """Restart core instances at other TP sizes (`libra.train.relayout`)."""
        assert self.replanner is not None
        want = {b: n for (b, _), n in zip(self.replanner.shape.buckets, layout, strict=True)}
        have = dict(zip(want, self._layout(), strict=True))
        self.report.event("relayout-start", have=have, want=want)
        took = await relayout(self.fleet, want, self.report.event)
        self.state.switches += 1
        self.view.switches = self.state.switches
        self.report.event("relayout-done", **took)
        # measured: the longest time a started instance's devices were out of service
        self.state.costs = dataclasses.replace(self.state.costs, restart_s=took["restart_s"])

    # -- validation -------------------------------------------------------------------

    def _start_validation(self, version: int) -> None:
        if self.val_runner is None or not self.val_tasks or self._tg is None:
            return
        self._val = self._tg.create_task(self._validate(version), name="libra-validation")

    async def _validate(self, version: int) -> None:
        assert self.val_runner is not None
        records: list[Trajectory] = []
        specs = list(episode_specs(self.val_tasks, 1, f"val-v{version}", version))
        self.view.validating = len(specs)

        def emit(r: Trajectory) -> None:
            records.append(r)
            self.view.validating -= 1

        t0 = time.monotonic()
        await run_episodes(self.val_runner, specs, concurrency=len(specs), emit=emit)
        reward = sum(r.reward for r in records) / max(len(records), 1)
        self.state.val_version, self.state.val_reward = version, reward
        self.view.val_version, self.view.val_reward = version, reward
        self.report.event(
            "validation",
            version=version,
            reward=reward,
            episodes=len(records),
            not_ok=sum(r.status != "ok" for r in records),
            wall_s=time.monotonic() - t0,
        )

    # -- display ----------------------------------------------------------------------

    async def _draw(self) -> None:
        period = 0.5 if self.display.mode == "live" else 5.0
        while True:
            self.view.workers = self.fleet.by_role()
            self.view.waiting = int(self.blocked)
            with contextlib.suppress(Exception):
                self.display.draw(self.view)
            await asyncio.sleep(period)


__all__ = ["Loop", "LoopState"]
