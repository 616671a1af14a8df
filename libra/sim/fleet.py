"""The rollout fleet: instances grouped in buckets, episodes routed by a real policy.

An episode runs turn by turn as a live rollout does: the policy places it (`on_start`),
each model turn is a segment decoded on one instance, the tool call takes its recorded
latency off the GPU, and after each tool return the policy answers `on_tool_return`
(stay or move). What an endpoint cannot serve is forced, as in `libra eval-routing`: a
turn that would outgrow its bucket's bound stops at the bound and moves to the next
bucket with room (an overflow demotion). Any move re-prefills the whole context on the
new instance; staying continues on the same instance, whose prefix cache holds the
context, so only the tool response is prefilled. A placed episode goes to the
least-loaded live instance (sequences per GPU) of its bucket, or, with `spill` dispatch
(the default), of its bucket and the larger ones: a bucket's bound is the longest context
it serves, so a larger bucket serves the episode too, and the policy's choice is a floor.
The policy is told that floor after each tool return (as a live engine, which runs an
episode in its routed bucket, tells it), not the bucket the episode spilled to: told the
larger one, C-MLFQ moved spilled short episodes "down" to the bucket it had chosen, a
full re-prefill each (issue #16: most of DAPO-Math's 26% re-prefilled tokens).
Without spilling, every episode's first turns queue on the smallest bucket (C-MLFQ, MLFQ
and static all start there), which the planner sized for the short episodes alone, while
the larger instances idle at the start of each batch.

A bucket is one TP size; an episode remembers the TP size of its bucket, so the buckets
(and their bounds) can change under it when a new plan is applied.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

from libra.planner import InstanceCost
from libra.routing import Bucket, Decision, EpisodeState, RoutingPolicy, StaticPolicy
from libra.sim.episodes import Episode
from libra.sim.instance import Instance
from libra.sim.loop import Loop


class Run:
    """One episode in flight (also the sequence an instance decodes)."""

    __slots__ = (
        "batch",
        "ctx",
        "d_end",
        "ep",
        "floor",
        "inst",
        "kv_off",
        "left",
        "pre_ctx",
        "pre_tokens",
        "seg",
        "states",
        "t0",
        "tp",
        "turn",
        "uid",
    )

    def __init__(self, ep: Episode, batch: int, uid: str, now: float):
        self.ep, self.batch, self.uid, self.t0 = ep, batch, uid, now
        self.turn, self.left, self.ctx, self.tp = 0, ep.gen[0], ep.prompt, 0
        self.floor = 0
        """TP size of the bucket the policy routed it to; with spilling it may run in a
        larger one (`tp`), and the policy is told this one, as a live engine, which
        runs an episode in its routed bucket, would tell it."""
        self.inst: Instance | None = None
        self.states: tuple[Any, ...] = ()
        self.seg = self.pre_tokens = self.pre_ctx = 0
        self.d_end = self.kv_off = 0.0

    def progress(self, done: int) -> None:
        """`done` tokens of the running segment were generated before the instance let
        go of it; what is left re-prefills the whole context wherever it runs next."""
        done = max(0, min(done, self.seg))
        self.ctx += done
        self.left -= done
        self.seg -= done
        self.pre_tokens, self.pre_ctx = self.ctx, 0


class Fleet:
    def __init__(
        self,
        loop: Loop,
        costs: dict[int, InstanceCost],
        max_seqs: int,
        finished: Callable[[Run, float], None],
    ):
        self.loop, self.costs, self.max_seqs, self.finished = loop, costs, max_seqs, finished
        self.instances: list[Instance] = []
        self.on_idle: Callable[[Instance, float], None] | None = None
        """Called when a live instance runs out of work (the elastic pool may lend it)."""
        self.policy: RoutingPolicy | None = None
        self.buckets: list[Bucket] = []
        self.moves = {"policy": 0, "overflow": 0, "reconfig": 0}
        self.reprefill_tokens = 0
        self.retired_busy_gpu_s = 0.0
        self.oracle = False
        """Diagnostic: start every episode in the bucket of its true final length (and
        place it exactly there: no spilling), or with `oracle_from`, route it so later."""
        self.oracle_from = 0
        """Diagnostic, with `oracle`: k > 0 places an episode as the policy does until its
        k-th tool return, then answers for the policy at every return: the bucket of the
        episode's true final length (a floor, as any policy's answer is)."""
        self.start_lengths: dict[str, float] | None = None
        """Diagnostic, with `oracle` (`SystemSpec.oracle_start = "prompt"`): the final
        length an episode starts by, per task id (its prompt's typical one), in place of
        its own; its bucket is the start answer as a policy's is (spilling allowed)."""
        self.spill = True
        """Place on the least-loaded instance of the chosen bucket or a larger one."""
        self._n = 0

    # --- layout -----------------------------------------------------------------------
    def set_routing(
        self, buckets: Sequence[Bucket], policy: RoutingPolicy, *, pooled: bool = False
    ) -> None:
        """Buckets (one per TP size) and the policy routing over them. `pooled`: one
        bucket holds every instance whatever its TP size (no length-aware routing)."""
        self.buckets = sorted(buckets, key=lambda b: b.bound)
        self.policy = policy
        # The static policy keeps every episode where it is: no state to build for it.
        self._consult = type(policy) is not StaticPolicy
        self.pooled = pooled
        self._bounds = [b.bound for b in self.buckets]
        self._tps = [b.tp for b in self.buckets]
        self._tpi = {b.tp: i for i, b in enumerate(self.buckets)}
        self._index = {b.name: i for i, b in enumerate(self.buckets)}
        self._last = len(self.buckets) - 1
        self._live: list[list[Instance]] = [[] for _ in self.buckets]
        for inst in self.instances:
            inst.bucket = -1
            if inst.role == "live":
                self._enlist(inst)

    def _enlist(self, inst: Instance) -> None:
        i = 0 if self.pooled else self._tpi.get(inst.tp, -1)
        inst.bucket = i
        if i >= 0:
            self._live[i].append(inst)

    def _delist(self, inst: Instance) -> None:
        if inst.bucket >= 0 and inst in self._live[inst.bucket]:
            self._live[inst.bucket].remove(inst)
        inst.bucket = -1

    def add(self, tp: int, ready_at: float) -> Instance:
        """A new instance of TP `tp`, serving from `ready_at` (engine start)."""
        self._n += 1
        inst = Instance(self._n, self.costs[tp], self.max_seqs, self.loop.at, self._seg_done)
        self.instances.append(inst)
        self.loop.at(ready_at, self._ready, inst)
        return inst

    def _ready(self, inst: Instance) -> None:
        if inst.role != "starting":
            return
        inst.role = "live"
        inst.t_ref = self.loop.now
        self._enlist(inst)
        if inst.bucket >= 0:
            self._rebalance(inst)

    def remove(self, inst: Instance) -> None:
        """Take `inst` out now: its episodes move elsewhere with what they generated
        (their KV cache is lost: a full re-prefill)."""
        now = self.loop.now
        self._delist(inst)
        was = inst.role
        inst.role = "gone"
        self.instances.remove(inst)
        if was == "starting":
            return
        self.retired_busy_gpu_s += inst.busy_s * inst.tp
        for run in inst.evict_all(now):
            moved = "reconfig" if run.pre_ctx or run.ctx > run.ep.prompt else None
            self._place(run, self._bucket(run), now, moved)

    def lend(self, inst: Instance) -> None:
        """An idle instance leaves rollout (a hybrid worker joins training)."""
        self._delist(inst)
        inst.role = "lent"

    def reclaim(self, inst: Instance, ready_at: float) -> None:
        inst.role = "starting"
        self.loop.at(ready_at, self._ready, inst)

    def count(self, role: str) -> int:
        return sum(1 for i in self.instances if i.role == role)

    def gpus(self, *roles: str) -> int:
        return sum(i.tp for i in self.instances if i.role in roles)

    def bucket_size(self, inst: Instance) -> int:
        """Live instances in the bucket `inst` serves (or served before it left)."""
        i = 0 if self.pooled else self._tpi.get(inst.tp, -1)
        return len(self._live[i]) if i >= 0 else 0

    def waiting(self) -> int:
        return sum(len(i.queue) for i in self.instances)

    def decode_slots(self) -> int:
        return self.max_seqs * self.count("live")

    def busy_gpu_s(self) -> float:
        return self.retired_busy_gpu_s + sum(i.busy_s * i.tp for i in self.instances)

    # --- episodes ---------------------------------------------------------------------
    def start(self, ep: Episode, batch: int, now: float) -> None:
        self._n += 1
        run = Run(ep, batch, f"{batch}/{self._n}", now)
        state = EpisodeState(run.uid, ep.task_id, ep.prompt, ep.prompt, (), "", 0)
        assert self.policy is not None
        bi = self._index.get(self.policy.on_start(state), 0)
        if self.oracle and self.start_lengths is not None:  # (diagnostic) as a policy would
            bi = self._fits(round(self.start_lengths[ep.task_id]))
        elif self._exact:
            bi = self._fits(ep.total)
        if bi < self._last and self._bounds[bi] < ep.prompt:
            bi = self._fits(ep.prompt)
            self.moves["overflow"] += 1
        self._place(run, bi, now, None)

    @property
    def _exact(self) -> bool:
        """Every episode starts in the bucket of its length, exactly (the oracle)."""
        return self.oracle and not self.oracle_from and self.start_lengths is None

    def _bucket(self, run: Run) -> int:
        """The bucket `run` was routed to (where it goes back to after losing its
        instance), or the smallest that fits it when the layout no longer has it."""
        i = self._tpi.get(run.floor)
        return i if i is not None else self._fits(run.ctx + 1)

    def _fits(self, tokens: int) -> int:
        return min(bisect.bisect_left(self._bounds, tokens), self._last)

    def _pick(self, bi: int, top: int | None = None) -> tuple[int, Instance | None]:
        """The least-loaded live instance of bucket `bi` (with spilling: of `bi` and the
        larger buckets up to `top`, the smaller bucket on a tie), else of the nearest
        bucket that has one (larger first: its bound fits)."""
        live = self._live[bi]
        top = self._last if top is None else top
        if live and (not self.spill or self._exact or bi >= top):
            return bi, min(live, key=_load) if len(live) > 1 else live[0]
        if live:
            best, where, load = None, bi, float("inf")
            for b in range(bi, top + 1):
                for inst in self._live[b]:
                    x = (len(inst.active) + len(inst.queue)) / inst.tp
                    if x < load:
                        best, where, load = inst, b, x
            return where, best
        for b in [*range(bi + 1, self._last + 1), *range(bi - 1, -1, -1)]:
            if self._live[b]:
                return b, min(self._live[b], key=_load)
        return bi, None

    def _place(
        self, run: Run, bi: int, now: float, moved: str | None, top: int | None = None
    ) -> None:
        """Prefill the whole context on an instance of bucket `bi` (a new episode, or a
        move: the KV cache does not travel); spilling no higher than bucket `top`."""
        if moved is not None:
            self.moves[moved] += 1
            self.reprefill_tokens += run.ctx
        run.pre_tokens, run.pre_ctx = run.ctx, 0
        run.floor = self._tps[bi]
        b, inst = self._pick(bi, top)
        if b < self._last and run.ctx >= self._bounds[b]:  # at the bound: next with room
            b, inst = self._pick(self._fits(run.ctx + 1))
        run.tp = self._tps[b]
        if inst is None:  # every instance is away (a reconfiguration): retry shortly
            self.loop.at(now + 1.0, self._retry, run)
            return
        self._submit(run, inst, b, now)

    def _retry(self, run: Run) -> None:
        self._place(run, self._bucket(run), self.loop.now, None)

    def _submit(self, run: Run, inst: Instance, bi: int, now: float) -> None:
        run.seg = run.left if bi >= self._last else min(run.left, self._bounds[bi] - run.ctx)
        run.inst = inst
        inst.submit(run, now)

    def _seg_done(self, inst: Instance, run: Run, now: float) -> None:
        seg = run.seg
        run.ctx += seg
        run.left -= seg
        if run.left > 0:  # the turn outgrew its bucket: overflow demotion
            self._place(run, self._fits(run.ctx + 1), now, "overflow")
        else:
            ep, t = run.ep, run.turn
            if t + 1 >= len(ep.gen):
                run.ctx += ep.tool[t]
                self.loop.at(now + ep.latency[t], self._finish, run)
            else:
                self.loop.at(now + ep.latency[t], self._tool_return, run)
        if self.on_idle is not None and inst.role == "live" and not inst.active and not inst.queue:
            self.on_idle(inst, now)

    def _tool_return(self, run: Run) -> None:
        now = self.loop.now
        ep, t = run.ep, run.turn
        u = ep.tool[t]
        ctx = run.ctx = run.ctx + u
        run.turn = t + 1
        run.left = ep.gen[t + 1]
        bi = self._tpi.get(run.tp)  # where it runs
        if bi is None:
            bi = self._fits(ctx + 1)
        fi = min(self._tpi.get(run.floor, bi), bi)  # where it was routed
        to, why = fi, "policy"
        states = ep.states[t]
        if self.oracle and self.oracle_from and run.turn >= self.oracle_from:
            to = self._fits(ep.total)  # (diagnostic) as a policy that knows would answer
        elif states and self._consult:
            run.states = run.states + states
            state = EpisodeState(
                run.uid, ep.task_id, ep.prompt, ctx, run.states, self.buckets[fi].name, t + 1
            )
            assert self.policy is not None
            ans = self.policy.on_tool_return(state)
            to = self._index.get(ans.bucket if isinstance(ans, Decision) else ans, fi)
        bounds, last = self._bounds, self._last
        if bi < last and ctx >= bounds[bi]:
            why = "overflow"  # it cannot stay: the context has reached the bound
            to = max(to, self._fits(ctx + 1))
        if to < last and ctx >= bounds[to]:
            to, why = self._fits(ctx + 1), "overflow"
        inst = run.inst
        # The policy's bucket is a floor: a larger bucket serves the episode too, so it
        # moves (a full re-prefill) only when the floor rises above where it runs, or
        # when the policy moves it down from the bucket it runs in (then to a smaller
        # one: a re-prefill that lands where it was would buy nothing).
        if fi <= to <= bi or to < fi < bi:  # (the latter spilled: the policy priced a
            run.floor = self._tps[to]  # move down from its bucket, not from this one)
            to = bi
        if to > bi:
            self._place(run, to, now, why)
        elif to < bi:
            self._place(run, to, now, why, top=bi - 1)
        elif inst is not None and inst.role == "live" and inst.bucket == bi:
            run.pre_tokens, run.pre_ctx = u, ctx - u
            run.seg = run.left if bi >= last else min(run.left, bounds[bi] - ctx)
            inst.submit(run, now)
        else:  # its instance left (removed or lent): the cache is lost
            self._place(run, self._bucket(run), now, "reconfig")

    def _finish(self, run: Run) -> None:
        self.finished(run, self.loop.now)

    def _rebalance(self, inst: Instance) -> None:
        """A new instance takes queued work that has no cache anywhere yet."""
        now = self.loop.now
        for other in self._live[inst.bucket]:
            if other is inst or not other.queue:
                continue
            keep: list[Run] = []
            for run in other.evict_queue():
                if run.pre_ctx == 0 and inst.load < other.load + len(keep):
                    run.inst = inst
                    inst.submit(run, now)
                else:
                    keep.append(run)
            other.queue.extend(keep)


def _load(inst: Instance) -> float:
    """Sequences per GPU: least-loaded across instances of different TP sizes."""
    return (len(inst.active) + len(inst.queue)) / inst.tp


class FleetMoveCost:
    """`libra.routing.MoveCost` for C-MLFQ's KV-aware moves, priced exactly as
    `libra.routing.PlannerCost` prices them (the planner's rollout cost model), from the
    fleet's instance types computed once rather than per decision."""

    def __init__(self, costs: dict[int, InstanceCost], batch: int = 32, chunk: int = 8192):
        self.costs, self.batch, self.chunk = costs, batch, chunk

    def decode_s_per_token(self, bucket: Bucket, context: float) -> float:
        return self.costs[bucket.tp].step_time(self.batch, self.batch * float(context))

    def prefill_s(self, bucket: Bucket, tokens: int) -> float:
        return self.costs[bucket.tp].prefill_time(tokens, 0.0, self.chunk)


__all__ = ["Fleet", "FleetMoveCost", "Run"]
