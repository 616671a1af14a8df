"""`ElasticTrainer`: the API `libra train` drives. Membership and the step, in the driver.

    trainer = ElasticTrainer(cfg)                  # or ElasticTrainer(cfg, resume=CKPT)
    trainer.start()                                # core replicas up, epoch 0 formed
    report = trainer.step(records)                 # one policy version (GRPO)
    trainer.add_hybrid("h0")                       # returns at once; joins live
    trainer.remove_hybrid("h0")                    # graceful: leaves after the next update
    trainer.save_weights(path)                     # HF model folder (what engines load)
    trainer.save_checkpoint(path)                  # sharded weights + optimizer + version
    trainer.close()

Each rank is a spawned process (`libra.trainer.ranks`, `libra.trainer.worker`). This
object keeps each replica's state (starting -> waiting -> joining -> ready -> leaving ->
left, or dropped), computes advantages over whole groups, and splits each step's
samples over the ranks that are ready. Getting new weights to inference engines is not
its job: `libra.weights` asks it for a folder (`save_weights`). Every call blocks; from
asyncio use `await asyncio.to_thread(trainer.step, records)`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

from libra.errors import ConfigError, TrainerError
from libra.record import Trajectory
from libra.trainer.checkpoint import check
from libra.trainer.config import TrainerConfig
from libra.trainer.ranks import START_TIMEOUT_S, Key, Ranks, RankStarter
from libra.trainer.report import MembershipEvent, ReplicaStatus, StepReport, StepResult
from libra.trainer.samples import Prepared, partition, prepare, split_minibatches
from libra.trainer.stepstats import aggregate

LIVE = ("waiting", "joining", "ready", "leaving")
"""States of a replica whose processes take part in every update."""
COORDINATOR: Key = ("core0", 0)
"""Core replica 0's rank 0 decides epochs; its results are the step's."""


class ElasticTrainer:
    """Core replicas for the whole run plus hybrid replicas that come and go."""

    def __init__(
        self, cfg: TrainerConfig, *, resume: str | None = None, starter: RankStarter | None = None,
        core_gpus: list[list[int]] | None = None,
    ):  # fmt: skip
        """`starter`: where the ranks run (default: processes on this machine;
        `libra.train.rayranks.RayStarter`: Ray actors on a cluster's nodes). `core_gpus`:
        on CUDA here, the GPUs of each core replica (default: the lowest free ones of
        `cfg.gpus`)."""
        self.cfg = cfg
        self._core_gpus = core_gpus or []
        meta = check(resume) if resume else {}
        self.version = int(meta.get("version", 0))
        self.updates = int(meta.get("updates", 0))
        self._ranks = Ranks(cfg, resume=resume, starter=starter)
        self._status: dict[str, ReplicaStatus] = {}
        self._spawned: dict[str, float] = {}
        self._events: list[MembershipEvent] = []
        self._stall: dict[str, float] = {}
        self._ids = itertools.count()
        self._tickets: dict[str, int] = {}
        """A hybrid's registration ticket (its last), to withdraw it if it is dropped."""
        self._between_steps = True
        """False from a step's first update until the step has ended: a step that
        raised leaves its ranks somewhere inside it."""
        self.saved_by = ""
        """The replica that wrote the last checkpoint."""

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._ranks.start()
        core = [f"core{i}" for i in range(self.cfg.elastic.core_replicas)]
        for i, c in enumerate(core):
            self._spawn(c, "core", core, gpus=self._core_gpus[i] if self._core_gpus else None)
        deadline = time.monotonic() + START_TIMEOUT_S
        for c in core:
            self._await_ready(c, deadline)

    def close(self) -> None:
        self._ranks.close()

    def __enter__(self) -> ElasticTrainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- membership -------------------------------------------------------------------

    def add_hybrid(
        self, replica_id: str | None = None, node: str | None = None,
        gpus: list[int] | None = None,
    ) -> str:  # fmt: skip
        """Start a hybrid replica (its processes); it registers, is admitted at an
        update boundary, catches up from a snapshot and then trains. Returns its id.
        `node`: where to start it if that node has room (on a cluster: the node whose
        devices the hybrid's engine just freed); `gpus`: on CUDA here, the GPUs its
        ranks take (those its engine freed; default: the lowest free ones)."""
        rid = replica_id or f"hybrid{next(self._ids)}"
        if rid in self._status and self._status[rid].state not in ("left", "dropped"):
            raise ConfigError(f"replica {rid!r} already exists")
        self._spawn(rid, "hybrid", [], node, gpus)
        return rid

    def remove_hybrid(self, replica_id: str) -> None:
        """Leave gracefully: its flag rides the next update's all-reduce; the others
        switch to the next epoch from the update after."""
        st = self._status.get(replica_id)
        if st is None or st.kind != "hybrid":
            raise ConfigError(f"no hybrid replica {replica_id!r}")
        if st.state in ("left", "dropped"):
            return
        try:
            if st.state == "starting":
                self._await_ready(replica_id, time.monotonic() + START_TIMEOUT_S)
            replies = self._ranks.ask(replica_id, ("leave",))
        except TrainerError:  # it died (its node lost): nothing left to leave
            self._drop(replica_id)
            return
        if any(r == ("ok", "withdrawn") for r in replies):
            st.state = "left"
            self._ranks.reap(replica_id)
        else:
            st.state = "leaving"

    def replicas(self) -> list[ReplicaStatus]:
        self._poll_starting()
        return [
            ReplicaStatus(**{f: getattr(s, f) for f in s.__slots__}) for s in self._status.values()
        ]

    def nodes(self) -> dict[str, str]:
        """Replica id -> the node its ranks run on (`local`: this machine), for every
        replica that has not left or been dropped."""
        return {rid: self._ranks.node(rid) for rid, st in self._status.items()
                if st.state not in ("left", "dropped")}  # fmt: skip

    @property
    def sender_host(self) -> str | None:
        """The address the weight broadcast's sender (rank 0 of core replica 0) binds
        to, when it runs on another node (None: this machine, `weights.host`)."""
        return self._ranks.host("core0") or None

    def take_events(self) -> list[MembershipEvent]:
        out, self._events = self._events, []
        return out

    # -- training ---------------------------------------------------------------------

    def step(self, records: Iterable[Trajectory]) -> StepReport:
        """Train one policy version on `records` (all of them; groups whole)."""
        t0 = time.perf_counter()
        prep = prepare(records, version=self.version, cfg=self.cfg.grpo)
        self._poll_starting()
        live = self._live()
        self._hand_out(prep, live)
        results: list[StepResult] = []
        self._between_steps = False
        for m in range(self.cfg.grpo.minibatches):
            u = self.updates + 1
            replies = self._update(u, m)
            results.append(replies[COORDINATOR])
            self._membership(replies)
            self.updates = u
        self.version += 1
        self._between_steps = True
        return aggregate(self, prep, results, time.perf_counter() - t0)

    def holder(self) -> str | None:
        """The replica that writes checkpoints: core replica 0, or, once it is gone,
        another core replica or a trained-up hybrid (all hold the same state, bit for
        bit). None when no live replica holds the state of `version` whole: a replica
        was lost inside a step, so the others may be between two of its updates."""
        return next(iter(self._holders()), None)

    def _holders(self) -> list[str]:
        if not self._between_steps:
            return []
        held = [rid for rid, s in self._status.items()
                if s.state in ("ready", "leaving") and self._ranks.alive(rid)]  # fmt: skip
        return sorted(held, key=lambda rid: (rid != "core0", self._status[rid].kind != "core"))

    def save_weights(self, path: str) -> str:
        """The current weights as an HF model folder at `path` (no optimizer), written
        atomically by core replica 0: what `libra.weights` hands to inference engines."""
        self._ranks.ask("core0", ("save", str(path), {"version": self.version}, False))
        return str(path)

    def save_checkpoint(self, path: str) -> str:
        """The `holder`'s weights and optimizer (core replica 0's while it runs), each
        rank writing its own shards, and the version at `path` (resume with
        `resume=path`, at any `replica_ranks`; not a model folder:
        `libra.trainer.checkpoint.export_model` makes one). After a core replica's loss
        between steps a survivor saves the state of `version`, so a resume redoes no
        step; `TrainerError` when none holds it."""
        why = (f"no live replica holds the state of step {self.version} whole (a "
               "replica was lost inside a step)")  # fmt: skip
        for rid in self._holders():  # the next one if this one is found gone too
            try:
                self._ranks.settle(rid)  # replies a step cut short by a loss still owes
                self._ranks.ask(rid, ("save", str(path), {"version": self.version}, True))
            except TrainerError as e:
                why = str(e)
                continue
            self.saved_by = rid
            return str(path)
        raise TrainerError(why)

    # -- weight broadcast (libra.trainer.broadcast; driven by libra.weights) -----------

    def broadcast_metas(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor `broadcast_send` sends, in order."""
        return list(self._ranks.ask("core0", ("wt", "metas"))[0])

    def broadcast_listen(self, gid: str, host: str, world: int, timeout_s: float) -> int:
        """Open group `gid`'s rendezvous on `host` (rank 0 of `world`); returns its port."""
        host = self.sender_host or host  # the sender's own node, when it runs elsewhere
        return int(self._ranks.ask("core0", ("wt", "listen", gid, host, world, timeout_s))[0])

    def broadcast_join(self, gid: str) -> str | None:
        """Wait until the server's ranks joined `gid`; an error message if they did not."""
        return self._ranks.ask("core0", ("wt", "join", gid))[0]

    def broadcast_send(self, gid: str, bucket_bytes: int) -> tuple[int, str | None]:
        """Send the current weights over `gid`: (the version sent, an error message or
        None). A failed group is closed; the trainer is unaffected."""
        return self.version, self._ranks.ask("core0", ("wt", "send", gid, bucket_bytes))[0]

    def broadcast_close(self, gid: str) -> None:
        self._ranks.ask("core0", ("wt", "close", gid))

    def state_hashes(self) -> dict[str, list[str]]:
        """Hash of parameters + optimizer state per ready replica that runs, per rank."""
        return {
            rid: [str(v) for v in self._ranks.ask(rid, ("hash",))]
            for rid, s in self._status.items()
            if s.state in ("ready", "leaving") and self._ranks.alive(rid)
        }

    # -- the step's parts -------------------------------------------------------------

    def _live(self) -> list[str]:
        return [rid for rid, s in self._status.items() if s.state in LIVE]

    def _hand_out(self, prep: Prepared, live: list[str]) -> None:
        """Give every live rank its share of each mini-batch (ready ranks only train;
        the others get empty shares but still take part in every update)."""
        ready = [rid for rid in live if self._status[rid].state in ("ready", "leaving")]
        slots = [(rid, k) for rid in ready for k in range(self._ranks.size(rid))]
        shares: dict[Key, list[list[Any]]] = {s: [] for s in slots}
        for mb in split_minibatches(prep.samples, self.cfg.grpo.minibatches):
            for s, part in zip(slots, partition(mb, len(slots)), strict=True):
                shares[s].append(part)
        for rid in live:
            for k in range(self._ranks.size(rid)):
                self._ranks.send(rid, k, ("version", self.version, shares.get((rid, k), [])))
        self._collect(live)

    def _update(self, u: int, m: int) -> dict[Key, StepResult]:
        """Run mini-batch `m` as optimizer update `u` on every live rank."""
        live = self._live()
        for rid in live:
            self._ranks.broadcast(rid, ("update", u, m))
        got = self._collect(live)
        return {k: v[1] for k, v in got.items() if v[0] == "step"}

    def _collect(self, rids: list[str]) -> dict[Key, Any]:
        got, failed = self._ranks.collect(rids)
        for rid in failed:
            self._drop(rid)
        return got

    # -- the membership state machine -------------------------------------------------

    def _spawn(
        self, rid: str, kind: str, core: list[str], node: str | None = None,
        gpus: list[int] | None = None,
    ) -> None:  # fmt: skip
        self._ranks.spawn(rid, kind, core, node, gpus)
        ranks = self.cfg.elastic.replica_ranks
        self._status[rid] = ReplicaStatus(rid, kind, "starting", ranks)  # type: ignore[arg-type]
        self._spawned[rid] = time.perf_counter()

    def _await_ready(self, rid: str, deadline: float) -> None:
        """starting -> ready (core) or waiting (a hybrid, once it has registered)."""
        self._ranks.await_ready(rid, deadline)
        st = self._status[rid]
        st.start_s = time.perf_counter() - self._spawned[rid]
        if st.kind == "hybrid":
            self._tickets[rid] = int(self._ranks.ask(rid, ("register",))[0])
        st.state = "ready" if st.kind == "core" else "waiting"

    def _poll_starting(self) -> None:
        for rid, st in list(self._status.items()):
            if st.state == "starting" and self._ranks.answered(rid):
                try:
                    self._await_ready(rid, time.monotonic() + 60)
                except TrainerError:
                    if st.kind == "core":
                        raise
                    self._drop(rid)  # a hybrid that died starting (its node lost)

    def _membership(self, replies: dict[Key, StepResult]) -> None:
        """What one update changed, as the coordinator and each hybrid's rank 0 saw it."""
        coord = replies[COORDINATOR]
        stall = sum(coord.timings.get(k, 0.0) for k in ("wait_group_s", "wait_copy_s", "recover_s"))
        for rid in coord.dropped:
            self._drop(rid, coord.update, coord.timings.get("recover_s", 0.0))
        for (rid, k), res in replies.items():
            st = self._status[rid]
            if k != 0 or st.kind == "core":
                continue
            if res.left:
                st.state = "left"
                self._events.append(
                    MembershipEvent("left", rid, res.update, stall_s=stall, reason=res.reason)
                )
                self._ranks.reap(rid)
            elif res.became_ready:
                st.state = "ready"
                st.join_latency_s = res.join_latency_s
                self._events.append(MembershipEvent("joined", rid, res.update, res.join_latency_s,
                                                    self._stall.pop(rid, 0.0) + stall))  # fmt: skip
            elif not res.applied and st.state == "waiting":
                st.state = "joining"
            if st.state == "joining":
                self._stall[rid] = self._stall.get(rid, 0.0) + stall

    def _drop(self, rid: str, update: int | None = None, stall: float = 0.0) -> None:
        st = self._status[rid]
        if st.state in ("dropped", "left"):
            return
        if st.state == "waiting" and rid in self._tickets:  # registered, maybe not admitted:
            self._ranks.cancel_ticket(self._tickets[rid])  # the coordinator must not admit it
        st.state = "dropped"
        self._events.append(MembershipEvent("dropped", rid, update or self.updates, stall_s=stall))
        self._ranks.kill(rid)


__all__ = ["ElasticTrainer"]
