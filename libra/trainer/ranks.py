"""The trainer's rank processes: spawning, the pipes to them, reaping. No membership.

`Ranks` hosts the run's rendezvous store, starts one spawned process per rank of a
replica (`libra.trainer.worker.main`), and moves command tuples over their pipes (the
protocol is in `libra.trainer.worker`). It knows which replicas are core, because the
failure rules differ: a core rank that dies or reports an error ends training
(`TrainerError`); a hybrid that does is reported back as failed, and `ElasticTrainer`
drops it. What a replica's state is (waiting, joining, ...) is the trainer's business.

Where the processes run is the starter's business (`RankStarter`): `LocalStarter`
spawns them here with `multiprocessing` (daemons: terminated when the driver's
interpreter exits; `close` stops them politely first) and, on CUDA, deals each rank one
GPU of `trainer.gpus` (`GpuPool`); `libra.train.rayranks` starts each replica's ranks in
Ray actors on one node (a GPU each from Ray on CUDA), and they call back over TCP
(`libra.trainer.remote`). Either way a rank is a handle with `is_alive`, `kill` and
`join`, and a connection that speaks the worker protocol.

`trainer.device = "auto"` is resolved once, here, against the starter's machines
(`RankStarter.cuda_here`), and the config every rank gets names the result, so all ranks
of a run compute on the same kind of device.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from libra.errors import TrainerError
from libra.trainer.config import TrainerConfig
from libra.trainer.device import resolve_type
from libra.trainer.rendezvous import PREFIX, host_store
from libra.trainer.worker import WorkerSpec, main

START_TIMEOUT_S = 900.0
"""Longest a replica may take from spawn to ready (model load, groups)."""

Key = tuple[str, int]
"""(replica id, rank within the replica)."""


class Started:
    """One rank's process, wherever it runs, and its connection. This base is a rank
    spawned here (a `multiprocessing` process and its pipe); a starter that places
    ranks on other nodes subclasses it (`libra.train.rayranks.RayRank`)."""

    node = "local"
    """The node it runs on (`local`: this machine)."""

    def __init__(self, process: Any, conn: Connection | None):
        self.process = process
        self.conn = conn

    @property
    def host(self) -> str:
        """The address its sockets bind to (empty: `elastic.host`, this machine)."""
        return ""

    def connection(self) -> Connection | None:
        """Its connection once it has one (a rank elsewhere calls back after it starts)."""
        return self.conn

    def is_alive(self) -> bool:
        return bool(self.process.is_alive())

    def kill(self) -> None:
        self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def why(self) -> str:
        """Why it is gone, as far as its starter knows."""
        return "see its log"


class RankStarter(Protocol):
    """Starts the ranks of one replica somewhere (this machine, or a cluster's node)."""

    def cuda_here(self) -> bool:
        """Do the machines it starts ranks on have GPUs (`trainer.device = "auto"`)?"""
        ...

    def open(self, cfg: TrainerConfig) -> str:
        """Get ready (`cfg.device` is resolved: `cpu` or `cuda`); the address the ranks
        reach the driver's rendezvous store at."""
        ...

    def start(
        self, rid: str, specs: list[WorkerSpec], prefer: str | None, gpus: list[int] | None
    ) -> list[Started]:
        """Start one process per spec (the ranks of replica `rid`, on one node; `prefer`:
        a node to use if it has room; `gpus`: on CUDA, the GPUs its ranks must take, one
        each, where the starter deals GPUs itself). Does not wait for them."""
        ...

    def release(self, rid: str) -> None:
        """`rid`'s processes are gone: free what they held (their node's resources)."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Rank:
    process: Started
    alive: bool = True
    owed: int = 1
    """Messages it still owes: its "ready", then one reply per command sent."""

    @property
    def conn(self) -> Connection:
        c = self.process.connection()
        assert c is not None, "rank has not connected yet"
        return c

    def connected(self) -> bool:
        return self.process.connection() is not None


class GpuPool:
    """The GPUs of this machine the trainer's ranks may take, one per rank, by replica."""

    def __init__(self, gpus: list[int]):
        self.gpus = list(gpus)
        self.held: dict[str, list[int]] = {}

    def free(self) -> list[int]:
        taken = {g for gs in self.held.values() for g in gs}
        return [g for g in self.gpus if g not in taken]

    def take(self, rid: str, n: int, want: list[int] | None = None) -> list[int]:
        """`n` GPUs for replica `rid`: `want` (each listed and free), else the lowest
        free ones; `TrainerError` naming the GPUs when they are not there."""
        free = self.free()
        if want is not None:
            if len(want) != n or any(g not in free for g in want):
                raise TrainerError(
                    f"replica {rid} was handed GPUs {want}: it needs {n}, each in "
                    f"trainer.gpus {self.gpus} and free (free: {free})"
                )
            picked = list(want)
        elif len(free) < n:
            raise TrainerError(
                f"replica {rid} needs {n} GPU(s), {len(free)} free of trainer.gpus "
                f"{self.gpus} (held: {self.held}); list more GPUs or lower "
                "elastic.replica_ranks / the replicas"
            )
        else:
            picked = free[:n]
        self.held[rid] = picked
        return picked

    def release(self, rid: str) -> None:
        self.held.pop(rid, None)


class LocalStarter:
    """Ranks as spawned processes of the driver, with pipes (one machine); on CUDA each
    rank gets one GPU of `trainer.gpus` (default: every GPU torch sees)."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.pool: GpuPool | None = None

    def cuda_here(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def open(self, cfg: TrainerConfig) -> str:
        if cfg.device == "cuda":
            import torch

            self.pool = GpuPool(cfg.gpus or list(range(torch.cuda.device_count())))
        return cfg.elastic.host

    def start(
        self, rid: str, specs: list[WorkerSpec], prefer: str | None, gpus: list[int] | None
    ) -> list[Started]:
        if self.pool is not None:
            dealt = self.pool.take(rid, len(specs), gpus)
            specs = [replace(s, gpu=g) for s, g in zip(specs, dealt, strict=True)]
        out = []
        for spec in specs:
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(
                target=main, args=(spec, child), name=f"libra-{rid}-{spec.rank}", daemon=True
            )
            p.start()
            child.close()
            out.append(Started(p, parent))
        return out

    def release(self, rid: str) -> None:
        if self.pool is not None:
            self.pool.release(rid)

    def close(self) -> None:
        pass


class Ranks:
    """Every rank process of a run, by replica id."""

    def __init__(
        self, cfg: TrainerConfig, *, resume: str | None = None, starter: RankStarter | None = None
    ):
        self.cfg = cfg
        self.resume = resume
        self.starter: RankStarter = starter or LocalStarter()
        self._store: Any = None
        self._store_host = cfg.elastic.host
        self._ranks: dict[str, list[_Rank]] = {}
        self._core: set[str] = set()

    def start(self) -> None:
        """Resolve the device, host the rendezvous store (before any rank is spawned)."""
        e = self.cfg.elastic
        kind = resolve_type(self.cfg.device, self.starter.cuda_here())
        self.cfg = self.cfg.model_copy(update={"device": kind})
        self._store_host = self.starter.open(self.cfg)
        self._store = host_store(e.host, e.port)

    def spawn(
        self, rid: str, kind: str, core_ids: list[str], prefer: str | None = None,
        gpus: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Start the processes of replica `rid`; they report ready on their own.
        `prefer`: the node to start it on if it has room (a hybrid's own node); `gpus`:
        on CUDA, the GPUs its ranks take (a hybrid's, those its engine left)."""
        e = self.cfg.elastic
        resume = self.resume if kind == "core" else None
        specs = [
            WorkerSpec(
                config=self.cfg.model_dump_json(),
                member_id=rid,
                kind=kind,
                rank=k,
                size=e.replica_ranks,
                core_ids=core_ids,
                port=self._store.port,
                resume=resume,
                store_host=self._store_host,
            )
            for k in range(e.replica_ranks)
        ]
        self._ranks[rid] = [_Rank(r) for r in self.starter.start(rid, specs, prefer, gpus)]
        if kind == "core":
            self._core.add(rid)

    def node(self, rid: str) -> str:
        """The node replica `rid` runs on (`local` on this machine)."""
        return self._ranks[rid][0].process.node

    def host(self, rid: str) -> str:
        """The address replica `rid`'s rank 0 binds to (empty: this machine's)."""
        return self._ranks[rid][0].process.host if rid in self._ranks else ""

    def size(self, rid: str) -> int:
        return len(self._ranks[rid])

    def answered(self, rid: str) -> bool:
        """Has every rank of `rid` a message waiting, or exited (a starting replica is
        ready, or `await_ready` will say it failed)?"""
        return all((r.connected() and r.conn.poll()) or not r.process.is_alive()
                   for r in self._ranks[rid])  # fmt: skip

    def await_ready(self, rid: str, deadline: float) -> None:
        """Block until every rank of `rid` reported ready (`deadline`: monotonic)."""
        for r in self._ranks[rid]:
            while not (r.connected() and r.conn.poll(0.1)):
                if not r.connected():
                    time.sleep(0.1)
                if not r.process.is_alive():
                    raise TrainerError(
                        f"replica {rid} exited during start{self._on(rid)} ({r.process.why()})"
                    )
                if time.monotonic() > deadline:
                    raise TrainerError(f"replica {rid} did not start in {START_TIMEOUT_S:.0f}s")
            _expect(rid, self._recv(rid, r), "ready")

    # -- commands ---------------------------------------------------------------------

    def send(self, rid: str, k: int, cmd: tuple) -> None:
        """Send to rank `k` of `rid`; a closed pipe marks the rank dead."""
        r = self._ranks[rid][k]
        try:
            r.conn.send(cmd)
        except OSError:
            r.alive = False
        else:
            r.owed += 1

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
        return [_expect(rid, self._recv(rid, r), "ok") if cmd[0] != "leave"
                else self._recv(rid, r) for r in self._ranks[rid]]  # fmt: skip

    def _recv(self, rid: str, r: _Rank) -> Any:
        """One reply; a rank whose connection closed (it died, its node is gone) raises
        `TrainerError` naming the replica and its node."""
        try:
            msg = r.conn.recv()
        except (EOFError, OSError):
            r.alive = False
            raise TrainerError(f"replica {rid} died{self._on(rid)}") from None
        r.owed -= 1
        return msg

    def alive(self, rid: str) -> bool:
        """Are all ranks of `rid` running?"""
        return all(r.alive and r.process.is_alive() for r in self._ranks[rid])

    def settle(self, rid: str, timeout_s: float = 60.0) -> None:
        """Read and drop the replies `rid` still owes (commands of a step that another
        replica's loss cut short), so that its next reply answers the next command."""
        for r in self._ranks[rid]:
            while r.owed > 0:
                if not r.conn.poll(timeout_s):
                    raise TrainerError(f"replica {rid} did not answer in {timeout_s:g} s")
                msg = self._recv(rid, r)
                if msg[0] == "error":
                    raise TrainerError(f"replica {rid}: {msg[1]}")

    def collect(self, rids: list[str]) -> tuple[dict[Key, Any], list[str]]:
        """One reply per live rank of `rids`, and the hybrids that failed meanwhile.

        A hybrid rank that dies or stays silent once every core rank has answered (plus
        the report window and 5 s) counts as ("dead", None); its replica, and one whose
        rank reported an error, is listed as failed (in the order the replies came). A
        core rank that dies or reports an error raises `TrainerError`."""
        for rid in rids:  # a core rank whose pipe broke on the send: nothing will come
            if rid in self._core and not all(r.alive for r in self._ranks[rid]):
                raise TrainerError(f"core replica {rid} died{self._on(rid)}")
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
                    want[key].owed -= 1
                except (EOFError, OSError):
                    got[key] = ("dead", None)
                    want[key].alive = False  # before Ray's view of the node catches up
            core_left = [k for k in want if k not in got and k[0] in self._core]
            if not core_left and core_done_at is None:
                core_done_at = time.monotonic()
            if core_done_at is not None and time.monotonic() - core_done_at > grace:
                for key in want:
                    got.setdefault(key, ("dead", None))
            for key in core_left:
                if not want[key].process.is_alive() and key not in got:
                    want[key].alive = False
                    where = self._on(key[0])
                    raise TrainerError(f"core replica {key[0]} rank {key[1]} died{where}")
        failed: list[str] = []
        for (rid, k), msg in got.items():
            if msg[0] not in ("dead", "error"):
                continue
            if rid in self._core:
                if msg[0] == "error":
                    raise TrainerError(f"core replica {rid}: {msg[1]}")
                # Its pipe closed: the process died (EOF comes before `is_alive` turns).
                raise TrainerError(f"core replica {rid} rank {k} died{self._on(rid)}")
            if rid not in failed:
                failed.append(rid)
        return got, failed

    # -- ending -----------------------------------------------------------------------

    def cancel_ticket(self, ticket: int) -> bool:
        """Withdraw a hybrid's registration for it (its processes are gone), as its own
        `cancel` would: False if the coordinator admitted it first (then the epoch's
        recovery drops it)."""
        from torch.distributed import PrefixStore

        store = PrefixStore(PREFIX, self._store)
        got = store.compare_set(f"ticket/{ticket}/state", "", "cancelled")
        return bytes(got) == b"cancelled"

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
        self.starter.release(rid)

    def _on(self, rid: str) -> str:
        """` on node N` for a replica placed on a cluster's node (empty here)."""
        node = self.node(rid) if rid in self._ranks else "local"
        return "" if node == "local" else f" on node {node}"

    def close(self) -> None:
        """Ask every live rank to stop, wait up to 30 s each, then kill what is left."""
        for ranks in self._ranks.values():
            for r in ranks:
                if r.alive and r.connected() and r.process.is_alive():
                    try:
                        r.conn.send(("stop",))
                    except OSError:
                        pass  # it exited between the check and the send: joined below
        for rid, ranks in self._ranks.items():
            for r in ranks:
                r.process.join(30 if r.connected() else 0)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join()
            self.starter.release(rid)
        self._ranks.clear()
        self.starter.close()


def _expect(rid: str, msg: Any, kind: str) -> Any:
    if msg[0] == "error":
        raise TrainerError(f"replica {rid}: {msg[1]}")
    if msg[0] != kind:
        raise TrainerError(f"replica {rid}: expected {kind!r}, got {msg[0]!r}")
    return msg[1]


__all__ = ["START_TIMEOUT_S", "GpuPool", "Key", "LocalStarter", "RankStarter", "Ranks", "Started"]
