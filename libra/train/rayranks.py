"""The trainer's ranks on the nodes of a Ray cluster (`[cluster] backend = "ray"`).

`RayStarter` is the trainer's `RankStarter` (`libra.trainer.ranks`) on Ray: each
replica's ranks are one group of children on one node (`libra.cluster.raychildren`:
one placement group of `trainer.elastic.replica_ranks` bundles of
`{"CPU": cluster.trainer_cpus}` (and `"GPU": 1` on CUDA), `STRICT_PACK`, so a replica
never spans nodes and replicas pack by node; a hybrid's asked for on the node its
engine just left). Each child runs `python -m libra.trainer.remote`, calls the
driver's hub back with the run's key (`libra.trainer.remote.Hub`) and gets its spec:
the store's address (the driver's machine) and its own (its node's, which its actor
puts in its environment). Output: `logs/trainer-{replica}-{rank}.log` in the run
folder.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from libra.cluster.config import ClusterSection
from libra.cluster.raychildren import RayChild, remove_group, start_group
from libra.trainer.config import TrainerConfig
from libra.trainer.ranks import Started
from libra.trainer.remote import Hub
from libra.trainer.worker import WorkerSpec

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RayRank(Started):
    """A rank in its actor on a Ray node, seen from the driver."""

    def __init__(self, child: RayChild, hub: Hub):
        super().__init__(child, None)
        self.child, self.hub = child, hub

    @property
    def node(self) -> str:  # type: ignore[override]
        return self.child.node

    @property
    def host(self) -> str:
        return self.child.host

    def connection(self) -> Connection | None:
        if self.conn is None:
            self.conn = self.hub.take(self.child.name)
        return self.conn

    def kill(self) -> None:
        self.hub.forget(self.child.name)
        self.child.kill()

    def why(self) -> str:
        return self.child.why()


class RayStarter:
    """Starts each replica's ranks on one Ray node (module doc)."""

    def __init__(self, section: ClusterSection, log_dir: Path):
        self.section = section
        self.log_dir = log_dir
        self.hub: Hub | None = None
        self._groups: dict[str, Any] = {}
        self.gpu = False
        """Each rank asks Ray for one GPU (`trainer.device` resolved to `cuda`)."""

    def cuda_here(self) -> bool:
        """Has the cluster any GPU (Ray's `GPU` resources)?"""
        from libra.cluster.raylaunch import _ray, connect

        connect(self.section)
        return float(_ray().cluster_resources().get("GPU", 0)) > 0

    def open(self, cfg: TrainerConfig) -> str:
        """The hub on every interface of the driver's machine; ranks reach it and the
        store at `elastic.host` when that is no loopback address, else at the address
        Ray knows this machine by."""
        from libra.cluster.raylaunch import _ray

        self.gpu = cfg.device == "cuda"
        host = cfg.elastic.host
        if host in LOOPBACK:
            host = _ray().util.get_node_ip_address()
        self.hub = Hub("0.0.0.0", host)
        return host

    def start(
        self, rid: str, specs: list[WorkerSpec], prefer: str | None, gpus: list[int] | None
    ) -> list[Started]:
        """`gpus` is not used: Ray gives each rank its GPU (the only one it sees)."""
        del gpus
        hub = self.hub
        assert hub is not None, "open() first"
        envs = []
        for spec in specs:
            name = f"trainer-{rid}/{spec.rank}"
            hub.expect(name, spec)
            envs.append(hub.env(name))  # its node's address comes from its actor
        logs = [self.log_dir / f"trainer-{rid}-{s.rank}.log" for s in specs]
        group, children = start_group(
            f"trainer-{rid}", "libra.trainer.remote", envs, logs, cpus=self.section.trainer_cpus,
            gpus=1 if self.gpu else 0, prefer=prefer, wait_s=self.section.placement_timeout_s,
        )  # fmt: skip
        self._groups[rid] = group
        return [RayRank(c, hub) for c in children]

    def release(self, rid: str) -> None:
        group = self._groups.pop(rid, None)
        if group is not None:
            remove_group(group)

    def close(self) -> None:
        for rid in list(self._groups):
            self.release(rid)
        if self.hub is not None:
            self.hub.close()


__all__ = ["RayRank", "RayStarter"]
