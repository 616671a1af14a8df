"""Processes of a job on the nodes of a Ray cluster, placed together on one node.

`start_group` asks Ray for one placement group of `n` bundles (`{"CPU": cpus}` each,
strategy `STRICT_PACK`: the group never spans nodes; `prefer` names a node to use if it
has room: Ray's soft target) and starts, in bundle k, a `ChildHost` actor that runs
`python -m MODULE` on its node: a child of the actor in its own process group that dies
with it (`libra.cluster.process`, as the engines), with `envs[k]` added to its
environment and its output in `log_paths[k]`. Nothing waits for Ray: `start_group`
returns at once, and each `RayChild` says where it runs once Ray has placed it.

What the children are is the caller's business: `libra.train.rayranks` starts the
trainer's ranks this way (one group per training replica).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from libra.cluster import process
from libra.cluster.raylaunch import EngineHost, RayProcess, _ray, ray_node

ENV_HOST = "LIBRA_NODE_HOST"
"""Set in every child's environment: the address of its node (its sockets bind there)."""


class ChildHost(EngineHost):
    """Runs in a Ray actor: starts one process on its node and answers for it (the polls,
    stop and kill of `EngineHost`)."""

    async def start_module(
        self, name: str, module: str, env: dict[str, str], log_path: str
    ) -> dict[str, Any]:
        import ray

        host = ray.util.get_node_ip_address()
        self.child = c = process.spawn(
            name, [sys.executable, "-m", module], log_path=Path(log_path),
            env={**os.environ, **env, ENV_HOST: host},
        )  # fmt: skip
        return {"node": str(ray.get_runtime_context().get_node_id()), "host": host,
                "pid": c.pid}  # fmt: skip


class RayChild:
    """One child in its actor, seen from the driver."""

    def __init__(self, name: str, actor: Any, ref: Any, group: Any, log_path: Path,
                 wait_s: float, bundle: dict[str, float]):  # fmt: skip
        self.name, self.actor, self.group, self.log_path = name, actor, group, log_path
        self._ref = ref
        """The actor's `start_module`: its answer says where the child runs."""
        self._proc: RayProcess | None = None
        self._deadline = time.monotonic() + wait_s
        self._wait_s, self._bundle = wait_s, bundle
        self._why = ""
        self._host = ""
        self._killed = False

    @property
    def node(self) -> str:
        """Its Ray node id: waits for Ray to place it and its actor to start it, up to
        the placement timeout the group was started with (`pending` after that, or once
        it is gone). A fixed 10 s was too short on a loaded machine: a Ray worker process
        alone took longer to start, and `fleet-started` named a node `pending`."""
        proc = self._started(max(0.0, self._deadline - time.monotonic()))
        return proc.node if proc is not None else "pending"

    @property
    def host(self) -> str:
        """Its node's address (empty until it is placed)."""
        self._started()
        return self._host

    @property
    def pid(self) -> int | None:
        """Its process id on its node (None until it is placed)."""
        proc = self._started()
        return proc.pid if proc is not None else None

    def is_alive(self) -> bool:
        """Placed and running, or still waiting for room (until the placement timeout).
        Never blocks: a lost actor reads as gone after its next poll (`RayProcess`)."""
        if self._why:
            return False
        proc = self._started()
        if proc is not None:
            return proc.returncode is None
        if time.monotonic() > self._deadline:
            self._why = (
                f"no Ray node had {self._bundle} free for it within {self._wait_s:g} s "
                "(`ray status` shows the cluster's resources; add nodes or ask for less)"
            )
            return False
        return True

    def kill(self) -> None:
        """Kill its process group, its actor and its placement group (once: a second
        call, as `Ranks.kill` then `reap` make, would wait again on an actor whose node
        is gone)."""
        if self._killed:
            return
        self._killed = True
        if self._proc is not None:
            self._proc.kill()
        else:
            self._release()

    def join(self, timeout: float | None = None) -> None:
        """Wait for it to exit by itself, then free its actor."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()

    def why(self) -> str:
        """Why it is gone, as far as Ray knows (else: its log)."""
        if self._why:
            return self._why
        if self._proc is not None:
            return f"{self._proc.last_error()}; log {self.log_path} on node {self.node}"
        return f"log {self.log_path}"

    def _started(self, wait_s: float = 0.0) -> RayProcess | None:
        """Its process once its actor has started it (waits up to `wait_s`)."""
        if self._proc is not None or self._why:
            return self._proc
        ray = _ray()
        ready, _ = ray.wait([self._ref], timeout=wait_s)
        if not ready:
            return None
        try:
            info = ray.get(self._ref)
        except ray.exceptions.RayError as e:
            self._why = f"its Ray actor failed to start it: {getattr(e, 'cause', None) or e}"
            self._release()
            return None
        self._host = str(info["host"])
        self._proc = RayProcess(self.name, "", 0.0, self.log_path, info["node"], info["pid"],
                                self.actor, self.group, self._bundle)  # fmt: skip
        return self._proc

    def _release(self) -> None:
        ray = _ray()
        with contextlib.suppress(Exception):  # already dead / removed
            ray.kill(self.actor)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


def start_group(
    name: str, module: str, envs: list[dict[str, str]], log_paths: list[Path], *,
    cpus: float, prefer: str | None, wait_s: float, gpus: int = 0,
) -> tuple[Any, list[RayChild]]:  # fmt: skip
    """One placement group of `len(envs)` bundles on one node, a child per bundle
    (module doc); returns the group (for `remove_group`) and the children. `gpus` per
    bundle: Ray sets each child's `CUDA_VISIBLE_DEVICES` to its own."""
    ray = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = placement_group(
        [dict(bundle) for _ in envs], strategy="STRICT_PACK", name=f"libra-{name}",
        _soft_target_node_id=ray_node(prefer or ""),
    )  # fmt: skip
    children = []
    for k, (env, log_path) in enumerate(zip(envs, log_paths, strict=True)):
        actor = (
            ray.remote(ChildHost)
            .options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=k
                ),
            )
            .remote()
        )
        ref = actor.start_module.remote(f"{name}/{k}", module, env, str(log_path))
        children.append(RayChild(f"{name}/{k}", actor, ref, group, log_path, wait_s, bundle))
    return group, children


def remove_group(group: Any) -> None:
    """Free a placement group (and whatever still runs in it)."""
    with contextlib.suppress(Exception):  # removed with a child already
        _ray().util.remove_placement_group(group)


__all__ = ["ENV_HOST", "ChildHost", "RayChild", "remove_group", "start_group"]
