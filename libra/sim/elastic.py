"""The elastic hybrid pool (Libra's fourth mechanism) on virtual time.

A hybrid worker is a rollout instance whose GPUs form whole data-parallel replicas of
the core trainer (its TP size a multiple of the trainer's TP x PP). When it runs out of
work while the rollout side has nothing waiting and no batch may start, it is lent to
training, if training is the bottleneck (the next step, with the hybrids already lent,
would take longer than the last batch's rollout did), a step is running that ends after
the hybrid could catch up (it can only train from the next step), and the next step
would hold it (below): it fetches a model + optimizer snapshot in the background
(`Trainer.fetch_s`; until then it contributes nothing and the core never waits for it).
A loan that cannot train costs its GPUs to the episodes still in tool calls.

At the start of a training step the pool decides how many caught-up hybrids train in
it: only while training is the bottleneck, i.e. while the step (with the hybrids added
so far) would take longer than the rollout of the last batch did, and only those that
shorten the iteration: a hybrid held in a step holds its GPUs from the next batch's
rollout until the step ends, so it must save the step more than it slows that rollout
(`_iteration`); none when the trainer's configuration cannot run the batch (it restarts
on another, whose replicas they may not form). The others go back to rollout at once.
A hybrid in a running step stays until the step ends (a graceful leave); one that is
not goes back as soon as rollout has work. Going back costs
`hybrid_wake_s`. Every bucket keeps at least one instance, so routing always has
somewhere to go.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from libra.sim.instance import Instance

if TYPE_CHECKING:
    from libra.sim.cluster import Simulation


class HybridPool:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.in_step: set[Instance] = set()
        """Hybrids training in the running step (they leave only when it ends)."""
        self.lent = 0
        self.trained_with = 0
        """Hybrid replica-steps: replicas that trained, summed over steps."""
        sim.fleet.on_idle = self.offer

    def eligible(self, inst: Instance) -> bool:
        r = self.sim.trainer.replica_gpus
        return inst.tp >= r and inst.tp % r == 0

    def starved(self) -> bool:
        """Rollout has nothing to do and may not start anything now."""
        sim = self.sim
        return sim.fleet.waiting() == 0 and not sim.releasable()

    def offer(self, inst: Instance, now: float) -> None:
        """A live instance just ran out of work: lend it if training can use it."""
        sim = self.sim
        if (
            sim.trained >= sim.steps - 1
            or sim.sync  # time-shared: every GPU trains anyway
            or not self.eligible(inst)
            or not self.starved()
            or sim.fleet.bucket_size(inst) <= 1
            or not self.training_bound()
        ):
            return
        fetch = sim.trainer.fetch_s()
        # A loan pays only from the next step on, and only caught up by then: lend while
        # a step runs that ends after the catch-up (the next starts no sooner), and only
        # if holding it in that step would shorten the iteration (`on_train_start`).
        if not sim.training or now + fetch > sim.train_until or not self._would_keep(inst):
            return
        sim.fleet.lend(inst)
        sim.trainer.hybrids[inst] = now + fetch
        sim.reconfig_gpu_s += inst.tp * fetch
        self.lent += 1
        sim.mark()

    def sweep(self, now: float) -> None:
        for inst in list(self.sim.fleet.instances):
            if inst.role == "live" and inst.idle:
                self.offer(inst, now)

    def on_train_start(self, now: float) -> None:
        """Keep the caught-up hybrids training needs for this step; free the rest."""
        sim, trainer = self.sim, self.sim.trainer
        self.sweep(now)
        ready = sorted(
            (i for i, t in trainer.hybrids.items() if t <= now), key=lambda i: (-i.tp, i.iid)
        )
        target = self._rollout_pace()
        stats = sim.env.stats(sim.trained)
        keep: list[Instance] = []
        rollout_gpus = sim.fleet.gpus("live", "starting", "draining", "lent")
        now_s = trainer.step_time(stats, 0)
        for inst in ready:
            # Each kept hybrid must shorten the iteration: the step, and the next
            # batch's rollout, which runs without the hybrid's GPUs until the step ends
            # (`_iteration`). None when the configuration cannot run this batch (the
            # trainer restarts on another, whose replicas the hybrids may not form).
            if not math.isfinite(now_s) or now_s <= target:
                break
            held = sum(i.tp for i in keep) + inst.tp
            with_it = trainer.step_time(stats, held)
            before = _iteration(now_s, target, held - inst.tp, rollout_gpus)
            if not _iteration(with_it, target, held, rollout_gpus) < before:
                break
            keep.append(inst)
            now_s = with_it
        for inst in ready[len(keep) :]:
            self._recall(inst, now)
        self.in_step = set(keep)
        self.trained_with += sum(i.tp // trainer.replica_gpus for i in keep)
        sim.mark()

    def _would_keep(self, inst: Instance) -> bool:
        """Would the next step, as `on_train_start` judges it, hold `inst` too?"""
        sim, trainer = self.sim, self.sim.trainer
        stats = sim.env.stats(min(sim.trained + 1, sim.steps - 1))
        lent = sum(i.tp for i in trainer.hybrids)
        before = trainer.step_time(stats, lent)
        after = trainer.step_time(stats, lent + inst.tp)
        pace = self._rollout_pace()
        gpus = sim.fleet.gpus("live", "starting", "draining", "lent")
        if not (math.isfinite(before) and math.isfinite(after)) or before <= pace:
            return False
        return _iteration(after, pace, lent + inst.tp, gpus) < _iteration(before, pace, lent, gpus)

    def training_bound(self) -> bool:
        """Would the next training step, with the hybrids already lent, still take
        longer than the last batch's rollout did? (Else lending cannot help.)"""
        sim, trainer = self.sim, self.sim.trainer
        pace = self._rollout_pace()
        step = min(sim.trained + (1 if sim.training else 0), sim.steps - 1)
        lent = sum(i.tp for i in trainer.hybrids)
        t = trainer.step_time(sim.env.stats(step), lent)
        # an infinite time: the configuration cannot run that batch and the trainer will
        # restart on another; a loan made for it may not fit the new replicas
        return pace > 0 and math.isfinite(t) and t > pace

    def _rollout_pace(self) -> float:
        """How long the last completed batch's rollout took (0 before the first)."""
        sim = self.sim
        done = [s for s in range(sim.next_batch) if not math.isnan(sim.done[s])]
        return sim.done[done[-1]] - sim.released[done[-1]] if done else 0.0

    def on_train_end(self, now: float) -> None:
        self.in_step = set()
        if not self.starved():
            self.recall_all(now)
        else:
            self.sweep(now)

    def on_release(self, now: float) -> None:
        """New episodes: hybrids not in the running step go back at once."""
        for inst in list(self.sim.trainer.hybrids):
            if inst not in self.in_step or not self.sim.training:
                self._recall(inst, now)
        self.sim.mark()

    def recall_all(self, now: float) -> None:
        for inst in list(self.sim.trainer.hybrids):
            self._recall(inst, now)
        self.in_step = set()
        self.sim.mark()

    def _recall(self, inst: Instance, now: float) -> None:
        sim = self.sim
        del sim.trainer.hybrids[inst]
        wake = sim.env.cfg.hybrid_wake_s
        sim.fleet.reclaim(inst, now + wake)
        sim.reconfig_gpu_s += inst.tp * wake


def _iteration(train_s: float, pace: float, held: int, rollout_gpus: int) -> float:
    """The iteration a step of `train_s` with `held` hybrid GPUs gives: the slower of the
    step and the next batch's rollout, which (released as the step starts) runs on the
    other `rollout_gpus - held` GPUs until the step ends, then on all of them; `pace` is
    that rollout's time on all of them (the last batch's)."""
    if held <= 0:
        return max(train_s, pace)
    if held >= rollout_gpus:
        return train_s + pace
    slow = pace * rollout_gpus / (rollout_gpus - held)  # the whole rollout without them
    rollout = slow if slow <= train_s else pace + train_s * held / rollout_gpus
    return max(train_s, rollout)


__all__ = ["HybridPool"]
