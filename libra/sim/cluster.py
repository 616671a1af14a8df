"""One system on one workload: the RL loop on virtual time.

    batch s released ──► episodes roll out on the fleet ──► batch s complete
                                                              │
    weights v reach rollout ◄── sync ◄── training step s ◄────┘ (trainer free)

An episode of step s may start once weights of version s - k are on the rollout side
(k = `staleness` for asynchronous systems, 0 for the synchronous colocated one, whose
rollout and training then alternate on the same GPUs). With `pipeline = "batch"` a batch
also waits for the previous batch's rollout to finish. After each training step the
system's controller may apply a new layout (`apply`): surplus instances are removed at
once (their episodes re-prefill elsewhere), new ones start after `engine_start_s` plus
their weight load, and the trainer switches configuration at its next step (a restart
unless the change is an elastic data-parallel one). A move into or out of a time-shared
(colocated) layout restarts every instance (the engines' memory share changes) and
switches the staleness bound between 0 and `staleness`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from libra.planner import instance_cost, weight_sync_time
from libra.routing import Bucket, RoutingConfig, make_policy
from libra.sim.control import make_controller
from libra.sim.elastic import HybridPool
from libra.sim.episodes import prompt_lengths
from libra.sim.fleet import Fleet, FleetMoveCost, Run
from libra.sim.instance import Instance
from libra.sim.layout import Env, Layout
from libra.sim.loop import Loop
from libra.sim.systems import SystemSpec
from libra.sim.trainer import Trainer


class Simulation:
    def __init__(self, spec: SystemSpec, env: Env, layout: Layout | None = None):
        """`layout`: start from this layout instead of the one the system chooses."""
        self.spec, self.env, cfg = spec, env, env.cfg
        self.steps = cfg.steps
        self.loop = Loop()
        self.controller = make_controller(spec, self)
        layout = layout or self.controller.initial_layout()
        self.sync = spec.sync or layout.shared
        """Rollout and training alternate on the same GPUs (staleness 0)."""
        settings = env.colocated_settings if self.sync else env.settings
        costs = self._costs(self.sync)
        self.fleet = Fleet(self.loop, costs, settings.rollout.max_num_seqs, self._episode_done)
        self.fleet.spill = cfg.dispatch == "spill"
        self.layout = layout
        self.initial_layout = layout
        self.trainer = Trainer(
            env.model,
            env.hw,
            env.settings.train,
            layout.train,
            elastic=spec.elastic,
            restart_s=cfg.train_restart_s,
        )
        self._cost = (
            FleetMoveCost(
                costs, RoutingConfig().decode_batch, settings.rollout.max_num_batched_tokens
            )
            if spec.routing == "cmlfq"
            else None
        )
        self._route(layout, None)
        for tp, n in layout.mix.items():
            for _ in range(n):
                self.fleet.add(tp, 0.0)
        self.pool = HybridPool(self) if spec.elastic else None
        self.k = 0 if self.sync else cfg.staleness
        nan = math.nan
        self.released, self.done = [nan] * self.steps, [nan] * self.steps
        self.t_start, self.t_end = [nan] * self.steps, [nan] * self.steps
        self.train_gpus = [0] * self.steps
        self.stalled_by = [0.0] * self.steps
        """Seconds of trainer restarts when each step ended (a restart in step s: a
        change made at the end of step s - 1 or as s began to train)."""
        self.restart_in = [0.0] * self.steps
        """Seconds of each step's training spent restarting the trainer (a batch that
        outgrew its configuration); a change the controller made waits before it."""
        self.remaining = [len(env.workload.batch(s)) for s in range(self.steps)]
        self.pending: dict[int, list[Any]] = defaultdict(list)
        self.version = self.trained = self.next_batch = 0
        self.training = False
        self.train_until = 0.0
        """When the running training step ends (set as it starts)."""
        self._wake_at = -1.0
        self.reconfig_gpu_s = 0.0
        self.decisions: list[dict[str, Any]] = []
        self.timeline: list[tuple[float, int, int, int]] = []
        self.mark()

    # --- the loop ---------------------------------------------------------------------
    def run(self, give_up: Callable[[], bool] | None = None) -> None:
        """Simulate `steps` steps, or until `give_up()` holds (a pilot that cannot win)."""
        self.loop.at(0.0, self._release)
        if give_up is None:
            self.loop.run(lambda: self.trained >= self.steps)
        else:
            self.loop.run(lambda: self.trained >= self.steps or give_up())

    def releasable(self) -> bool:
        s = self.next_batch
        if s >= self.steps or self.version < s - self.k:
            return False
        return self.env.cfg.pipeline == "stream" or s == 0 or not math.isnan(self.done[s - 1])

    def _release(self) -> None:
        now = self.loop.now
        released = False
        while self.releasable():
            s = self.next_batch
            self.next_batch += 1
            self.released[s] = now
            batch = self.env.workload.batch(s)
            if self.fleet.start_lengths is not None:
                self.fleet.start_lengths.update(prompt_lengths(batch))
            for ep in batch:
                self.fleet.start(ep, s, now)
            released = True
        if released and self.pool is not None:
            self.pool.on_release(now)

    def _episode_done(self, run: Run, now: float) -> None:
        s = run.batch
        self.remaining[s] -= 1
        self.pending[s].append(run.ep.record)
        if self.remaining[s]:
            return
        self.done[s] = now
        # Between-steps learning (the paper's): the policy learns a step's episodes when
        # the step is complete. Handing them over then, rather than as each finishes, is
        # the same for the policy and spares it re-sorting interleaved steps.
        policy = self.fleet.policy
        assert policy is not None
        for record in self.pending.pop(s):
            policy.on_finish(record)
        end_step = getattr(policy, "end_step", None)
        if end_step is not None:
            end_step(run.ep.record.step)
        self._maybe_train()
        if self.env.cfg.pipeline == "batch":
            self._release()

    def _maybe_train(self) -> None:
        s, now = self.trained, self.loop.now
        if self.training or s >= self.steps or math.isnan(self.done[s]):
            return
        if self.trainer.stall_until > now:  # the trainer is restarting
            if self._wake_at != self.trainer.stall_until:
                self._wake_at = self.trainer.stall_until
                self.loop.at(self._wake_at, self._maybe_train)
            return
        stats = self.env.stats(s)
        if not self.trainer.fits(stats, self.layout.train.gpus):
            # The batch fits no configuration on the training GPUs (a system that moved
            # GPUs to rollout before the lengths grew): the controller gives training
            # GPUs back, as an operator would after the out-of-memory error.
            self.controller.grow_training(s, stats)
            if self.trainer.stall_until > now:
                self._maybe_train()  # waits for the restart
                return
        if self.pool is not None:
            self.pool.on_train_start(now)
        dur, gpus = self.trainer.step(stats, now)
        self.restart_in[s] = max(0.0, self.trainer.stall_until - now)
        self.training = True
        self.train_until = now + dur
        self.t_start[s], self.train_gpus[s] = now, gpus
        self.trainer.busy_gpu_s += dur * gpus
        self.loop.at(now + dur, self._train_end, s)

    def _train_end(self, s: int) -> None:
        now = self.loop.now
        self.training = False
        self.trained = s + 1
        self.t_end[s] = now
        self.stalled_by[s] = self.trainer.stall_s
        if self.trained < self.steps:
            self.controller.on_step_end(s)
            if self.pool is not None:
                self.pool.on_train_end(now)
        sync = weight_sync_time(self.env.model, self.env.hw, min(self.layout.mix))
        self.loop.at(now + sync, self._new_version, s + 1)
        self._maybe_train()

    def _new_version(self, v: int) -> None:
        self.version = max(self.version, v)
        self._release()

    # --- reconfiguration ----------------------------------------------------------------
    def apply(self, layout: Layout) -> None:
        """Move to `layout` now (see the module docstring for what it costs)."""
        now, env, fleet = self.loop.now, self.env, self.fleet
        if self.pool is not None:
            self.pool.recall_all(now)
        self._route(layout, fleet.policy)
        shared = self.spec.sync or layout.shared
        if shared != self.sync:
            # Into or out of time-sharing: every engine restarts with the other memory
            # share (its KV capacity changes) and the staleness bound changes.
            self.sync, self.k = shared, 0 if shared else env.cfg.staleness
            fleet.costs = self._costs(shared)
            if self._cost is not None:
                self._cost.costs = fleet.costs
            for inst in list(fleet.instances):
                fleet.remove(inst)
        by_tp: dict[int, list[Instance]] = defaultdict(list)
        for inst in fleet.instances:
            by_tp[inst.tp].append(inst)
        for tp, insts in by_tp.items():
            surplus = len(insts) - layout.mix.get(tp, 0)
            order = sorted(insts, key=lambda i: (i.role != "starting", i.load, -i.iid))
            for inst in order[: max(0, surplus)]:
                fleet.remove(inst)
        bw = env.hw.inter_node_bandwidth * env.hw.eff.comm
        for tp, n in layout.mix.items():
            delay = env.cfg.engine_start_s + env.model.weight_bytes / tp / bw
            for _ in range(n - len(by_tp.get(tp, []))):
                fleet.add(tp, now + delay)
                self.reconfig_gpu_s += tp * delay
        self.trainer.change(layout.train, now)
        self.layout = layout
        self.mark()

    def _costs(self, sync: bool) -> dict[int, Any]:
        """Instance costs per TP size; a time-shared layout's engines get less memory."""
        env = self.env
        settings = env.colocated_settings if sync else env.settings
        return {
            tp: instance_cost(env.model, env.hw, tp, settings.rollout) for tp in env.tps(settings)
        }

    def _route(self, layout: Layout, old: Any) -> None:
        """Route over `layout`'s buckets with a fresh policy (keeping what C-MLFQ has
        learned: it is about episodes, not buckets)."""
        pooled = self.spec.routing == "pooled"
        if pooled:
            buckets = [Bucket("pool", max(layout.mix), self.env.max_context)]
        else:
            buckets = layout.buckets()
        name = "static" if self.spec.routing in ("pooled", "oracle") else self.spec.routing
        policy = make_policy(name, buckets, self.env.cfg.routing, cost=self._cost)
        if old is not None and hasattr(old, "tree") and hasattr(policy, "tree"):
            policy.tree = old.tree
        self.fleet.set_routing(buckets, policy, pooled=pooled)
        self.fleet.oracle = self.spec.routing == "oracle"
        self.fleet.oracle_from = self.spec.oracle_from
        prompt = self.fleet.oracle and self.spec.oracle_start == "prompt"
        if prompt and self.fleet.start_lengths is None:
            self.fleet.start_lengths = {}
        elif not prompt:
            self.fleet.start_lengths = None

    def mark(self) -> None:
        """Record the GPU allocation now (for the plot)."""
        hybrid = sum(i.tp for i in getattr(self.trainer, "hybrids", {}))
        rollout = self.fleet.gpus("live", "starting", "draining")
        train = self.trainer.config.gpus if hasattr(self, "trainer") else 0
        self.timeline.append((self.loop.now, train + hybrid, rollout, hybrid))


__all__ = ["Simulation"]
