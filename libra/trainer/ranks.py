"""The trainer's rank processes: spawning, the pipes to them, reaping. No membership.

`Ranks` hosts the run's rendezvous store, starts one spawned process per rank of a
replica (`libra.trainer.worker.main`), and moves command tuples over their pipes (the
protocol is in `libra.trainer.worker`). It knows which replicas are core, because the
failure rules differ: a core rank that dies or reports an error ends training
(`TrainerError`); a hybrid that does is reported back as failed, and `ElasticTrainer`
drops it. What a replica's state is (waiting, joining, ...) is the trainer's business.

The processes are daemons: multiprocessing terminates them when the driver's
interpreter exits. `close` stops them politely first.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from libra.errors import TrainerError
from libra.trainer.config import TrainerConfig
from libra.trainer.rendezvous import host_store
from libra.trainer.worker import WorkerSpec, main

START_TIMEOUT_S = 900.0
"""Longest a replica may take from spawn to ready (model load, groups)."""

Key = tuple[str, int]
"""(replica id, rank within the replica)."""


@dataclass(slots=True)
class _Rank:
    process: Any
    conn: Connection
    alive: bool = True


class Ranks:
    """Every rank process of a run, by replica id."""

    def __init__(self, cfg: TrainerConfig, *, resume: str | None = None):
        self.cfg = cfg
        self.resume = resume
        self._ctx = mp.get_context("spawn")
        self._store: Any = None
        self._ranks: dict[str, list[_Rank]] = {}
        self._core: set[str] = set()

    def start(self) -> None:
        """Host the rendezvous store (before any rank is spawned)."""
        e = self.cfg.elastic
        self._store = host_store(e.host, e.port)

    def spawn(self, rid: str, kind: str, core_ids: list[str]) -> None:
        """Start the processes of replica `rid`; they report ready on their own."""
        e = self.cfg.elastic
        ranks = []
        for k in range(e.replica_ranks):
            parent, child = self._ctx.Pipe()
            spec = WorkerSpec(
                config=self.cfg.model_dump_json(), member_id=rid, kind=kind, rank=k,
                size=e.replica_ranks, core_ids=core_ids, port=self._store.port,
                resume=self.resume if kind == "core" else None,
            )  # fmt: skip
            p = self._ctx.Process(
                target=main, args=(spec, child), name=f"libra-{rid}-{k}", daemon=True
            )
            p.start()
            child.close()
            ranks.append(_Rank(p, parent))
        self._ranks[rid] = ranks
        if kind == "core":
            self._core.add(rid)

    def size(self, rid: str) -> int:
        return len(self._ranks[rid])

    def answered(self, rid: str) -> bool:
        """Has every rank of `rid` a message waiting (a starting replica is ready)?"""
        return all(r.conn.poll() for r in self._ranks[rid])

    def await_ready(self, rid: str, deadline: float) -> None:
        """Block until every rank of `rid` reported ready (`deadline`: monotonic)."""
        for r in self._ranks[rid]:
            while not r.conn.poll(0.1):
                if not r.process.is_alive():
                    raise TrainerError(f"replica {rid} exited during start (see its log)")
                if time.monotonic() > deadline:
                    raise TrainerError(f"replica {rid} did not start in {START_TIMEOUT_S:.0f}s")
            _expect(rid, r.conn.recv(), "ready")

    # -- commands ---------------------------------------------------------------------

    def send(self, rid: str, k: int, cmd: tuple) -> None:
        """Send to rank `k` of `rid`; a closed pipe marks the rank dead."""
        r = self._ranks[rid][k]
        try:
            r.conn.send(cmd)
        except OSError:
            r.alive = False

    def broadcast(self, rid: str, cmd: tuple) -> None:
        """Send to every live rank of `rid`."""
        for k, r in enumerate(self._ranks[rid]):
            if r.alive:
                self.send(rid, k, cmd)

    def ask(self, rid: str, cmd: tuple) -> list[Any]:
        """Send to every rank of `rid` and wait for each one's ("ok", value); `leave`
        returns the raw replies (a hybrid may answer that it withdrew)."""
        for k in range(len(self._ranks[rid])):
            self.send(rid, k, cmd)
        return [_expect(rid, r.conn.recv(), "ok") if cmd[0] != "leave" else r.conn.recv()
                for r in self._ranks[rid]]  # fmt: skip

    def collect(self, rids: list[str]) -> tuple[dict[Key, Any], list[str]]:
        """One reply per live rank of `rids`, and the hybrids that failed meanwhile.

        A hybrid rank that dies or stays silent once every core rank has answered (plus
        the report window and 5 s) counts as ("dead", None); its replica, and one whose
        rank reported an error, is listed as failed (in the order the replies came). A
        core rank that dies or reports an error raises `TrainerError`."""
        want = {(rid, k): r for rid in rids for k, r in enumerate(self._ranks[rid]) if r.alive}
        got: dict[Key, Any] = {}
        core_done_at = None
        grace = self.cfg.elastic.report_window_s + 5
        while len(got) < len(want):
            pending: dict[Any, Key] = {r.conn: key for key, r in want.items() if key not in got}
            for conn in wait(list(pending), timeout=0.2):
                key = pending[conn]
                try:
                    got[key] = conn.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    got[key] = ("dead", None)
            core_left = [k for k in want if k not in got and k[0] in self._core]
            if not core_left and core_done_at is None:
                core_done_at = time.monotonic()
            if core_done_at is not None and time.monotonic() - core_done_at > grace:
                for key in want:
                    got.setdefault(key, ("dead", None))
            for key in core_left:
                if not want[key].process.is_alive() and key not in got:
                    raise TrainerError(f"core replica {key[0]} rank {key[1]} died")
        failed: list[str] = []
        for (rid, k), msg in got.items():
            if msg[0] not in ("dead", "error"):
                continue
            if rid in self._core:
                if msg[0] == "error":
                    raise TrainerError(f"core replica {rid}: {msg[1]}")
                # Its pipe closed: the process died (EOF comes before `is_alive` turns).
                raise TrainerError(f"core replica {rid} rank {k} died")
            if rid not in failed:
                failed.append(rid)
        return got, failed

    # -- ending -----------------------------------------------------------------------

    def kill(self, rid: str) -> None:
        """Kill the processes of `rid` now (a failed replica) and reap them."""
        for r in self._ranks[rid]:
            r.alive = False
            if r.process.is_alive():
                r.process.kill()
        self.reap(rid)

    def reap(self, rid: str) -> None:
        """Wait for the processes of `rid`, which exit by themselves (a leaver)."""
        for r in self._ranks[rid]:
            r.alive = False
            r.process.join(30)

    def close(self) -> None:
        """Ask every live rank to stop, wait up to 30 s each, then kill what is left."""
        for ranks in self._ranks.values():
            for r in ranks:
                if r.alive and r.process.is_alive():
                    try:
                        r.conn.send(("stop",))
                    except OSError:
                        pass  # it exited between the check and the send: joined below
        for ranks in self._ranks.values():
            for r in ranks:
                r.process.join(30)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join()
        self._ranks.clear()


def _expect(rid: str, msg: Any, kind: str) -> Any:
    if msg[0] == "error":
        raise TrainerError(f"replica {rid}: {msg[1]}")
    if msg[0] != kind:
        raise TrainerError(f"replica {rid}: expected {kind!r}, got {msg[0]!r}")
    return msg[1]


__all__ = ["START_TIMEOUT_S", "Key", "Ranks"]
