"""`ElasticTrainer`: the API `libra train` drives. Owns the trainer processes.

    trainer = ElasticTrainer(cfg)                  # or ElasticTrainer(cfg, resume=CKPT)
    trainer.start()                                # core replicas up, epoch 0 formed
    report = trainer.step(records)                 # one policy version (GRPO)
    trainer.add_hybrid("h0")                       # returns at once; joins live
    trainer.remove_hybrid("h0")                    # graceful: leaves after the next update
    trainer.save_checkpoint(path)                  # model folder + optimizer + version
    trainer.close()

Each rank is a spawned process (`libra.trainer.worker`); this object talks to them over
pipes, hosts the rendezvous store, computes advantages over whole groups, and splits each
step's samples over the ranks that are ready. Every call blocks; from asyncio use
`await asyncio.to_thread(trainer.step, records)`.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from libra.errors import ConfigError, TrainerError
from libra.record import Trajectory
from libra.trainer import publish
from libra.trainer.checkpoint import read_meta
from libra.trainer.config import TrainerConfig
from libra.trainer.elastic import StepResult
from libra.trainer.rendezvous import host_store
from libra.trainer.report import MembershipEvent, ReplicaStatus, StepReport
from libra.trainer.samples import partition, prepare, split_minibatches
from libra.trainer.stepstats import aggregate
from libra.trainer.worker import WorkerSpec, main

START_TIMEOUT_S = 900.0


@dataclass(slots=True)
class _Rank:
    process: Any
    conn: Connection
    alive: bool = True


class ElasticTrainer:
    """Core replicas for the whole run plus hybrid replicas that come and go."""

    def __init__(self, cfg: TrainerConfig, *, resume: str | None = None):
        self.cfg = cfg
        self.resume = resume
        meta = read_meta(resume) if resume else {}
        if resume and not meta:
            raise ConfigError(f"{resume} is not a trainer checkpoint (no trainer_state.json)")
        self.version = int(meta.get("version", 0))
        self.updates = int(meta.get("updates", 0))
        self._store: Any = None
        self._ctx = mp.get_context("spawn")
        self._ranks: dict[str, list[_Rank]] = {}
        self._status: dict[str, ReplicaStatus] = {}
        self._spawned: dict[str, float] = {}
        self._events: list[MembershipEvent] = []
        self._stall: dict[str, float] = {}
        self._ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        e = self.cfg.elastic
        self._store = host_store(e.host, e.port)
        core = [f"core{i}" for i in range(e.core_replicas)]
        for c in core:
            self._spawn(c, "core", core)
        deadline = time.monotonic() + START_TIMEOUT_S
        for c in core:
            self._await_ready(c, deadline)

    def close(self) -> None:
        for ranks in self._ranks.values():
            for r in ranks:
                if r.alive and r.process.is_alive():
                    try:
                        r.conn.send(("stop",))
                    except OSError:
                        pass
        for ranks in self._ranks.values():
            for r in ranks:
                r.process.join(30)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join()
        self._ranks.clear()

    def __enter__(self) -> ElasticTrainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- membership -------------------------------------------------------------------

    def add_hybrid(self, replica_id: str | None = None) -> str:
        """Start a hybrid replica (its processes); it registers, is admitted at an
        update boundary, catches up from a snapshot and then trains. Returns its id."""
        rid = replica_id or f"hybrid{next(self._ids)}"
        if rid in self._status and self._status[rid].state not in ("left", "dropped"):
            raise ConfigError(f"replica {rid!r} already exists")
        self._spawn(rid, "hybrid", [])
        return rid

    def remove_hybrid(self, replica_id: str) -> None:
        """Leave gracefully: its flag rides the next update's all-reduce; the others
        switch to the next epoch from the update after."""
        st = self._status.get(replica_id)
        if st is None or st.kind != "hybrid":
            raise ConfigError(f"no hybrid replica {replica_id!r}")
        if st.state in ("left", "dropped"):
            return
        if st.state == "starting":
            self._await_ready(replica_id, time.monotonic() + START_TIMEOUT_S)
        replies = self._ask(replica_id, ("leave",))
        if any(r == ("ok", "withdrawn") for r in replies):
            st.state = "left"
            self._reap(replica_id)
        else:
            st.state = "leaving"

    def replicas(self) -> list[ReplicaStatus]:
        self._poll_starting()
        return [
            ReplicaStatus(**{f: getattr(s, f) for f in s.__slots__}) for s in self._status.values()
        ]

    # -- training ---------------------------------------------------------------------

    def step(self, records: Iterable[Trajectory]) -> StepReport:
        """Train one policy version on `records` (all of them; groups whole)."""
        t0 = time.perf_counter()
        g = self.cfg.grpo
        prep = prepare(records, version=self.version, cfg=g)
        self._poll_starting()
        live = [
            rid
            for rid, s in self._status.items()
            if s.state in ("waiting", "joining", "ready", "leaving")
        ]
        ready = [rid for rid in live if self._status[rid].state in ("ready", "leaving")]
        slots = [(rid, k) for rid in ready for k in range(len(self._ranks[rid]))]
        shares: dict[tuple[str, int], list[list[Any]]] = {s: [] for s in slots}
        for mb in split_minibatches(prep.samples, g.minibatches):
            for s, part in zip(slots, partition(mb, len(slots)), strict=True):
                shares[s].append(part)
        for rid in live:
            for k, r in enumerate(self._ranks[rid]):
                self._send(r, ("version", self.version, shares.get((rid, k), [])))
        self._collect(live)
        results: list[StepResult] = []
        for m in range(g.minibatches):
            u = self.updates + 1
            replies = self._broadcast_update(u, m)
            results.append(replies[self._coordinator()])
            self._membership(replies)
            self.updates = u
        self.version += 1
        report = aggregate(self, prep, results, time.perf_counter() - t0)
        if self.cfg.publish.dir and self.version % self.cfg.publish.every == 0:
            report.published = str(self.publish())
        return report

    def publish(self) -> Any:
        """Write the current weights as `{publish.dir}/v{version}` and tell endpoints."""
        cfg = self.cfg.publish
        if cfg.dir is None:
            raise ConfigError("trainer.publish.dir is not set")
        path = publish.version_dir(cfg, self.version)
        self._ask(self._core0(), ("save", str(path), {"version": self.version}, False))
        publish.notify(cfg, path)
        publish.prune(cfg)
        return path

    def save_checkpoint(self, path: str) -> str:
        """Model folder + optimizer + version at `path` (resume with `resume=path`)."""
        self._ask(self._core0(), ("save", str(path), {"version": self.version}, True))
        return str(path)

    def state_hashes(self) -> dict[str, list[str]]:
        """Hash of parameters + optimizer state per ready replica, per rank."""
        return {
            rid: [str(v) for v in self._ask(rid, ("hash",))]
            for rid, s in self._status.items()
            if s.state in ("ready", "leaving")
        }

    # -- internals --------------------------------------------------------------------

    def _core0(self) -> str:
        return "core0"

    def _coordinator(self) -> tuple[str, int]:
        return ("core0", 0)

    def _spawn(self, rid: str, kind: str, core: list[str]) -> None:
        e = self.cfg.elastic
        ranks = []
        for k in range(e.replica_ranks):
            parent, child = self._ctx.Pipe()
            spec = WorkerSpec(
                config=self.cfg.model_dump_json(), member_id=rid, kind=kind, rank=k,
                size=e.replica_ranks, core_ids=core, port=self._store.port,
                resume=self.resume if kind == "core" else None,
            )  # fmt: skip
            p = self._ctx.Process(
                target=main, args=(spec, child), name=f"libra-{rid}-{k}", daemon=True
            )
            p.start()
            child.close()
            ranks.append(_Rank(p, parent))
        self._ranks[rid] = ranks
        self._status[rid] = ReplicaStatus(rid, kind, "starting", e.replica_ranks)  # type: ignore[arg-type]
        self._spawned[rid] = time.perf_counter()

    def _await_ready(self, rid: str, deadline: float) -> None:
        for r in self._ranks[rid]:
            while not r.conn.poll(0.1):
                if not r.process.is_alive():
                    raise TrainerError(f"replica {rid} exited during start (see its log)")
                if time.monotonic() > deadline:
                    raise TrainerError(f"replica {rid} did not start in {START_TIMEOUT_S:.0f}s")
            self._expect(rid, r.conn.recv(), "ready")
        st = self._status[rid]
        st.start_s = time.perf_counter() - self._spawned[rid]
        if st.kind == "hybrid":
            self._ask(rid, ("register",))
        st.state = "ready" if st.kind == "core" else "waiting"

    def _poll_starting(self) -> None:
        for rid, st in self._status.items():
            if st.state == "starting" and all(r.conn.poll() for r in self._ranks[rid]):
                self._await_ready(rid, time.monotonic() + 60)

    def _expect(self, rid: str, msg: Any, kind: str) -> Any:
        if msg[0] == "error":
            raise TrainerError(f"replica {rid}: {msg[1]}")
        if msg[0] != kind:
            raise TrainerError(f"replica {rid}: expected {kind!r}, got {msg[0]!r}")
        return msg[1]

    def _send(self, r: _Rank, cmd: tuple) -> None:
        try:
            r.conn.send(cmd)
        except OSError:
            r.alive = False

    def _ask(self, rid: str, cmd: tuple) -> list[Any]:
        for r in self._ranks[rid]:
            self._send(r, cmd)
        return [self._expect(rid, r.conn.recv(), "ok") if cmd[0] != "leave" else r.conn.recv()
                for r in self._ranks[rid]]  # fmt: skip

    def _collect(self, rids: list[str]) -> dict[tuple[str, int], Any]:
        """One reply per live rank of `rids`; hybrids that die or stay silent once the
        core has answered (plus the report window) are marked dropped."""
        want = {(rid, k): r for rid in rids for k, r in enumerate(self._ranks[rid]) if r.alive}
        got: dict[tuple[str, int], Any] = {}
        core_done_at = None
        grace = self.cfg.elastic.report_window_s + 5
        while len(got) < len(want):
            pending: dict[Any, tuple[str, int]] = {
                r.conn: key for key, r in want.items() if key not in got
            }
            for conn in wait(list(pending), timeout=0.2):
                key = pending[conn]
                try:
                    got[key] = conn.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    got[key] = ("dead", None)
            core_left = [k for k in want if k not in got and self._status[k[0]].kind == "core"]
            if not core_left and core_done_at is None:
                core_done_at = time.monotonic()
            if core_done_at is not None and time.monotonic() - core_done_at > grace:
                for key in want:
                    got.setdefault(key, ("dead", None))
            for key in core_left:
                if not want[key].process.is_alive() and key not in got:
                    raise TrainerError(f"core replica {key[0]} rank {key[1]} died")
        for key, msg in got.items():
            if msg[0] == "dead":
                self._drop(key[0])
            elif msg[0] == "error":
                if self._status[key[0]].kind == "core":
                    raise TrainerError(f"core replica {key[0]}: {msg[1]}")
                self._drop(key[0])
        return got

    def _broadcast_update(self, u: int, m: int) -> dict[tuple[str, int], StepResult]:
        live = [
            rid
            for rid, s in self._status.items()
            if s.state in ("waiting", "joining", "ready", "leaving")
        ]
        for rid in live:
            for r in self._ranks[rid]:
                if r.alive:
                    self._send(r, ("update", u, m))
        got = self._collect(live)
        return {k: v[1] for k, v in got.items() if v[0] == "step"}

    def _membership(self, replies: dict[tuple[str, int], StepResult]) -> None:
        coord = replies[self._coordinator()]
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
                self._reap(rid)
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
        st.state = "dropped"
        self._events.append(MembershipEvent("dropped", rid, update or self.updates, stall_s=stall))
        for r in self._ranks[rid]:
            r.alive = False
            if r.process.is_alive():
                r.process.kill()
        self._reap(rid)

    def _reap(self, rid: str) -> None:
        for r in self._ranks[rid]:
            r.alive = False
            r.process.join(30)

    def take_events(self) -> list[MembershipEvent]:
        out, self._events = self._events, []
        return out


__all__ = ["ElasticTrainer"]
