"""The planner's decisions applied to a live run: hybrids switching roles, core rollout
instances restarted at other TP sizes, and the measured costs the next decision uses.

After every step the loop hands over the step's measurements (`after_step`). A step
that ran wholly in one assignment (no switch in progress, every hybrid replica ready or
gone, the same assignment at its start and its end) is recorded as that assignment's
measurement (`Replanner.observe`); steps in a transition belong to no assignment and no
decision is taken during one, nor before the running assignment has `MIN_OWN_STEPS` of
its own. Then the replanner (`libra.train.planning`, pure)
decides; an applied decision runs as a task of the loop's TaskGroup while training goes
on, one at a time. Every switch measures what it cost (drain, engine stop / start,
trainer registration, a joiner's catch-up) and those figures replace the estimates in
`LoopState.costs`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from libra.planner import Signals, WorkloadStats
from libra.record import Trajectory
from libra.train.display import View
from libra.train.handle import TrainerHandle
from libra.train.placement import trained_on
from libra.train.planning import Assignment, Replanner, Workload
from libra.train.relayout import relayout
from libra.train.report import Report
from libra.train.roles import to_rollout, to_training
from libra.train.state import LoopState
from libra.train.workers import Fleet

MIN_OWN_STEPS = 2
"""Steps the running assignment is measured over before a decision may change it: one
step is too noisy to judge (the first fills the pipeline; on a shared machine a step
can take twice the next), and a decision on it flipped a run back and forth."""


class Reconfigurer:
    """Applies the replanner's choices to the fleet and the trainer."""

    def __init__(
        self,
        *,
        replanner: Replanner | None,
        fleet: Fleet,
        trainer: TrainerHandle,
        state: LoopState,
        report: Report,
        view: View,
        steps: int,
        decode_slots: int,
        bucket: str,
    ):
        self.replanner, self.fleet, self.trainer = replanner, fleet, trainer
        self.state, self.report, self.view = state, report, view
        self.steps = steps
        self.decode_slots = decode_slots
        """Sequences one rollout engine decodes at once."""
        self.bucket = bucket
        """Where a hybrid that returns to rollout serves (the first bucket)."""
        self._switch: asyncio.Task[None] | None = None
        self._to_train_s = 0.0
        self._settled: Assignment | None = replanner.current if replanner else None
        """The assignment at the end of the last step (at the start: the starting one),
        None if a transition was under way."""

    @property
    def busy(self) -> bool:
        return self._switch is not None and not self._switch.done()

    def after_step(
        self,
        row: dict[str, Any],
        records: list[Trajectory],
        finished: list[Trajectory],
        tg: asyncio.TaskGroup,
    ) -> None:
        """Ask the replanner about the step just trained (`records`, with `finished` the
        episodes that ended meanwhile); an applied decision starts as a task of `tg`."""
        if self.replanner is None:
            return
        engines = sum(1 for w in self.fleet.workers if w.role == "rollout")
        signals = Signals(
            step=row["step"],
            rollout_s=row["rollout_s"],
            train_s=row["train_s"],
            decode_slots=max(engines, 1) * self.decode_slots,
        )
        work = Workload(
            rollout=WorkloadStats.from_records(finished or records),
            train=WorkloadStats.from_records(records),
        )
        ran = self._ran(row)
        if ran is not None:
            self.replanner.observe(ran, signals, work)
        if (
            self.busy
            or self._settled is None  # decide on settled measurements only
            or self.replanner.measured.steps(self.replanner.current) < MIN_OWN_STEPS
        ):
            return
        remaining = self.steps - row["step"]
        out = self.replanner.consider(signals, work, remaining, self.state.costs)
        if out is None:
            return
        decision, target = out
        self.report.decision(self.replanner.log[-1])
        numbers = (
            f"gain {decision.predicted_gain_s:,.0f} s vs cost {decision.reconfig_cost_s:,.1f} s"
        )
        if decision.apply:
            note = f"moving to {target.train} hybrid(s) training ({numbers})"
            if target.layout and target.layout != self.layout():
                note = f"{note}, core layout {self.replanner.key(target)}"
        else:
            note = f"kept {self.replanner.current.train} hybrid(s) training ({decision.reason})"
        self.view.last_decision = f"v{row['step']}: {note}"
        if decision.apply:
            self._switch = tg.create_task(self.apply(target), name="libra-switch")

    def _ran(self, row: dict[str, Any]) -> Assignment | None:
        """The assignment this whole step ran in (module doc), or None."""
        assert self.replanner is not None
        moving = ("starting", "waiting", "joining", "leaving")
        replicas = row["replicas"]  # replica id -> state, as the step's report saw them
        training = self.fleet.hybrids("train")
        now: Assignment | None = Assignment(
            len(training), self.replanner.shape.hybrids, self.layout()
        )
        if (
            self.busy
            or any(state in moving for state in replicas.values())
            or any(replicas.get(w.id) != "ready" for w in training)  # not in this step yet
        ):
            now = None
        before, self._settled = self._settled, now
        return now if now is not None and now == before else None

    def on_trainer_events(self, events: list[Any], row: dict[str, Any]) -> None:
        """Log the trainer's membership events; a hybrid's join sets the measured cost
        of moving to training (the switch itself, then its catch-up)."""
        for e in events:
            self.report.event(
                f"trainer-{e.kind}",
                replica=e.replica,
                update=e.update,
                join_latency_s=e.join_latency_s,
                core_stall_s=e.stall_s,
            )
            if e.kind == "joined" and e.join_latency_s is not None:
                self._cost(to_train_s=self._to_train_s + e.join_latency_s)
                row["join_latency_s"] = e.join_latency_s

    def _cost(self, **measured: float) -> None:
        self.state.costs = dataclasses.replace(self.state.costs, **measured)

    def _switched(self) -> None:
        self.state.switches += 1
        self.view.switches = self.state.switches

    async def apply(self, target: Assignment) -> None:
        """Move hybrids until `target.train` of them train, then the core layout."""
        while len(self.fleet.hybrids("train")) < target.train:
            w = self.fleet.hybrids("rollout")[0]
            self.report.event("switch-start", worker=w.id, to="train")
            took = await to_training(self.fleet, self.trainer, w)
            self._switched()
            # where its training replica runs: this machine, or the Ray node it got
            nodes = await self.trainer.nodes()
            trained_on(self.fleet.placement, w.id, nodes)
            self.report.event("switch-done", worker=w.id, to="train",
                              node=nodes.get(w.id, self.fleet.placement.node), **took)  # fmt: skip
            self._to_train_s = took["total_s"]
            self._cost(to_train_s=took["total_s"])
        while len(self.fleet.hybrids("train")) > target.train:
            w = self.fleet.hybrids("train")[-1]
            self.report.event("switch-start", worker=w.id, to="rollout")
            took = await to_rollout(self.fleet, self.trainer, w, self.bucket)
            self._switched()
            node = w.engine.slot.node if w.engine is not None else None
            self.report.event("switch-done", worker=w.id, to="rollout", node=node, **took)
            self._cost(to_rollout_s=took["total_s"])
        if target.layout and target.layout != self.layout():
            await self.relayout(target.layout)

    def layout(self) -> tuple[int, ...]:
        """Core rollout instances per bucket now (with the replanner's buckets)."""
        if self.replanner is None or not self.replanner.shape.buckets:
            return ()
        core = [w.bucket for w in self.fleet.workers if w.kind == "core-rollout"]
        return tuple(core.count(b) for b, _ in self.replanner.shape.buckets)

    async def relayout(self, layout: tuple[int, ...]) -> None:
        """Restart core instances at other TP sizes (`libra.train.relayout`)."""
        assert self.replanner is not None
        want = {b: n for (b, _), n in zip(self.replanner.shape.buckets, layout, strict=True)}
        have = dict(zip(want, self.layout(), strict=True))
        self.report.event("relayout-start", have=have, want=want)
        took = await relayout(self.fleet, want, self.report.event)
        self._switched()
        self.report.event("relayout-done", **took)
        # measured: the longest time a started instance's devices were out of service
        self._cost(restart_s=took["restart_s"])

    def cancel(self) -> None:
        if self._switch is not None:
            self._switch.cancel()


__all__ = ["Reconfigurer"]
