"""The asynchronous GRPO loop. One TaskGroup owns every task it starts.

    batch of step v ready ──► trainer.step ──► weights.publish(v + 1) ──► admit on v + 1
          ▲  (rollouts for the next steps keep running meanwhile)         │
          └──────────────── metrics row, replan, validation, checkpoint ◄─┘

- `Rollouts` admits and runs episodes and hands over each step's batch
  (`libra.train.rollouts`).
- A step trains as soon as its batch is ready. Then the new weights go to every engine
  through the weight sync, one engine at a time; turns in flight finish on the old
  weights and every turn records the version that produced it. Only then does admission
  move to the new version, so a group's admitted version never exceeds what its first
  turn runs on.
- Validation of version v runs right after v is published; v + 1 is published only when
  it finished, so every validation episode runs on one version.
- After each step the planner may move hybrids or restart core instances
  (`libra.train.reconfig`), in a task beside the loop.
- A step whose gradient is not finite leaves the weights as they were
  (`Replica.apply`); the loop says so (an `update-skipped` event) and stops the run
  after `max_skipped` such steps in a row: the model has diverged, and going on would
  only spend the fleet. Likewise after `max_failed` steps in a row whose episodes all
  ended `error` (`libra.train.guards`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from libra.errors import TrainerError, WeightsNotDelivered
from libra.train.display import Display, View
from libra.train.groups import Tally
from libra.train.guards import FailedSteps, SkippedUpdates, going_on
from libra.train.handle import TrainerHandle
from libra.train.metrics import StepTimes, step_row
from libra.train.reconfig import Reconfigurer
from libra.train.report import Report
from libra.train.rollouts import Rollouts
from libra.train.state import LoopState
from libra.train.validation import Validation
from libra.trainer.report import StepReport
from libra.weights import WeightSync


@dataclass(slots=True)
class Telemetry:
    """Where a run's progress goes: files (`report`), the terminal (`display`) and the
    panel's model (`view`)."""

    report: Report
    display: Display
    view: View


class Loop:
    def __init__(
        self,
        *,
        steps: int,
        checkpoint_every: int,
        max_skipped: int,
        max_failed: int,
        rollouts: Rollouts,
        trainer: TrainerHandle,
        weights: WeightSync,
        reconfig: Reconfigurer,
        validation: Validation | None,
        telemetry: Telemetry,
        state: LoopState,
        checkpoint: Callable[[], Awaitable[None]],
        roles: Callable[[], dict[str, list[str]]],
        on_lost: Callable[[list[tuple[str, str]]], Awaitable[None]],
    ):
        self.steps, self.checkpoint_every = steps, checkpoint_every
        self.skipped = SkippedUpdates(max_skipped)
        self.failed = FailedSteps(max_failed)
        self.rollouts, self.trainer, self.weights = rollouts, trainer, weights
        self.reconfig, self.validation = reconfig, validation
        self.report, self.display, self.view = telemetry.report, telemetry.display, telemetry.view
        self.state, self.checkpoint, self.roles = state, checkpoint, roles
        self.on_lost = on_lost
        """Replace the engines a publication could not reach (`Fleet.replace_lost`)."""
        self.stopping = False
        self.checkpointed = rollouts.version
        """Version of the last checkpoint written by this loop."""
        self._tg: asyncio.TaskGroup | None = None
        self._val: asyncio.Task[None] | None = None

    def request_stop(self) -> None:
        """Ctrl-C: stop admitting, finish the step in progress, checkpoint, exit."""
        self.stopping = True
        self.view.note = (
            "stopping: finishing the step in progress, then saving a checkpoint "
            "(Ctrl-C again stops at once; resume with the same command)"
        )
        self.rollouts.stop()

    async def run(self) -> str:
        """Train to `steps`; returns `done` or `interrupted`."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            admit = tg.create_task(self.rollouts.run(), name="libra-rollouts")
            draw = tg.create_task(self._draw(), name="libra-display")
            try:
                v = self.rollouts.version
                if v == 0 or self.state.val_version != v:
                    self._start_validation(v)
                outcome = await self._train()
                if self._val is not None and outcome == "done":
                    await self._val
            finally:
                for t in (admit, draw, self._val):
                    if t is not None:
                        t.cancel()
                self.reconfig.cancel()
        return outcome

    async def _train(self) -> str:
        assert self._tg is not None
        t_start = t_prev = time.monotonic()
        while self.rollouts.version < self.steps:
            t_wait = time.monotonic()
            batch = await self.rollouts.next_batch()
            if batch is None:
                return "interrupted"
            v = self.rollouts.version
            records = [r for g in batch for r in g.records]
            t0 = time.monotonic()
            try:
                rep = await self.trainer.step(records)
            except TrainerError as e:  # a core replica is gone (its node, its process)
                raise await self._stopped(e) from None
            t1 = time.monotonic()
            if self._val is not None:  # validation of v runs on v's weights only
                await self._val
            publish_s = await self._publish(rep.version)
            self.rollouts.advance()
            await self.rollouts.finish_step(v)
            now = time.monotonic()
            times = StepTimes(now - t_prev, t0 - t_wait, t1 - t0, publish_s, now - t_start)
            t_prev = now
            tally, busy_s, finished = self.rollouts.take()
            row = step_row(
                rep, batch, records, v, times, tally=tally, busy_s=busy_s,
                reward=self.rollouts.step_rewards(v, records), roles=self.roles(),
                val=(self.state.val_version, self.state.val_reward),
                switches=self.state.switches,
            )  # fmt: skip
            self.reconfig.on_trainer_events(rep.events, row)
            self.report.step(row)
            self.display.step(row)
            self._update_view(row)
            self.reconfig.after_step(row, records, finished, self._tg)
            self._check_update(rep)
            self._check_failures(rep.version, tally)
            if self.validation is not None and self.validation.due(rep.version):
                self._start_validation(rep.version)
            if rep.version % self.checkpoint_every == 0 or self.stopping:
                await self.checkpoint()
                self.checkpointed = rep.version
            if self.stopping:
                return "interrupted"
        return "done"

    def _check_update(self, rep: StepReport) -> None:
        """Report a skipped update; stop the run at `max_skipped` in a row."""
        n = self.skipped.after_step(rep.version, rep.grad_norm, rep.tokens)
        if not n:
            return
        self.report.event("update-skipped", step=rep.version, grad_norm=str(rep.grad_norm),
                          in_a_row=n)  # fmt: skip
        self.view.note = self.skipped.note(rep.version, rep.grad_norm)
        self.display.line(f"  {self.view.note}")
        if self.skipped.stop:
            self.report.event("diverged", steps=self.skipped.steps,
                              checkpoint_step=self.checkpointed)  # fmt: skip
            raise self.skipped.error(self.checkpointed)

    def _check_failures(self, step: int, tally: Tally) -> None:
        """Report a step whose episodes all ended `error`; stop at `max_failed` in a row."""
        n = self.failed.after_step(step, tally.episodes, tally.errors)
        if not n:
            return
        self.report.event("all-episodes-failed", step=step, episodes=tally.episodes,
                          errors=dict(tally.errors.most_common(3)), in_a_row=n)  # fmt: skip
        self.view.note = self.failed.note(step, tally.errors)
        self.display.line(f"  {self.view.note}")
        if self.failed.stop:
            raise self.failed.error(self.checkpointed)

    async def _stopped(self, e: TrainerError) -> TrainerError:
        """The run cannot go on without a core replica: one line naming it (and its
        node) and how to go on, and a `trainer-failed` event. A loss between two steps
        leaves the state of the current step whole in every other trained-up replica
        (another core replica, a hybrid in training): the checkpoint is saved from one
        of them first, so the resume redoes no step."""
        saved_from = None
        if self.trainer.version > self.checkpointed and await self.trainer.holder():
            try:
                await self.checkpoint()
                self.checkpointed = self.trainer.version
                saved_from = self.trainer.saved_by
            except TrainerError as failed:  # they went too: the last checkpoint stands
                self.report.event("checkpoint-failed", why=str(failed))
        v = self.checkpointed
        then = going_on(v)
        if saved_from is not None:
            then += f" (saved from {saved_from} after the loss)"
        self.report.event("trainer-failed", why=str(e), checkpoint_step=v, saved_from=saved_from)
        return TrainerError(f"{e}; training stopped, the same command {then}")

    async def _publish(self, version: int) -> float:
        """Publish `version`; engines it could not reach are replaced (the fleet's
        restarts per worker; beyond them the run stops in one line)."""
        t0 = time.monotonic()
        try:
            return await self.weights.publish(version)
        except WeightsNotDelivered as e:
            self.report.event("weights-not-delivered", version=version,
                              lost=[{"url": u, "why": w} for u, w in e.lost])  # fmt: skip
            self.view.note = str(e)
            await self.on_lost(e.lost)
            return time.monotonic() - t0

    def _update_view(self, row: dict[str, Any]) -> None:
        v = self.view
        v.stepped(row["step"])
        v.reward = row["reward"]
        if self.state.first_reward is None:
            self.state.first_reward = row["reward"]
        v.reward_first = self.state.first_reward
        v.kept, v.dropped = row["groups"], row["groups_dropped"]
        v.tokens_per_s, v.gen_tokens_per_s = row["tokens_per_s"], row["gen_tokens_per_s"]
        v.train_tokens_per_s = row["train_tokens_per_s"]
        v.migrations += row["migrations"]

    def _start_validation(self, version: int) -> None:
        if self.validation is None or self._tg is None:
            return
        job = self.validation.run(version, self.state, self.report, self.view)
        self._val = self._tg.create_task(job, name="libra-validation")

    async def _draw(self) -> None:
        period = 0.5 if self.display.mode == "live" else 5.0
        while True:
            self.view.workers = self.roles()
            self.view.waiting = int(self.rollouts.blocked)
            try:
                self.display.draw(self.view)
            except OSError:  # a terminal that went away must not stop training: the
                pass  # run's files keep the record (and `lines` mode writes per step)
            await asyncio.sleep(period)


__all__ = ["Loop", "Telemetry"]
